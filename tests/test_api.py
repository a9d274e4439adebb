"""The public contract: names and signatures exactly as the core issue fixes them."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import gradstat
import gradstat.clip_grads
from tests._cli import run_gradstat

SIGNATURES = {
    "get_grad_norm_fp32": "(grads_for_norm, norm_type=2, grad_stats_parallel_group=None)",
    "clip_grad_by_total_norm_fp32": (
        "(parameters, max_norm, total_norm, use_decoupled_grad=False)"
    ),
    "count_zeros_fp32": (
        "(parameters, grad_stats_parallel_group, use_decoupled_grad=False, tp_group=None, "
        "expert_tp_group=None, *, gtp_group=None, expert_gtp_group=None)"
    ),
    "param_is_not_shared": "(param)",
    "param_is_not_tensor_parallel_duplicate": "(param, tp_group=None, expert_tp_group=None)",
    "param_is_not_gtp_duplicate": "(param, gtp_group=None, expert_gtp_group=None)",
    "gtp_local_pad_zero_count": "(gtp_shard, range_start, range_end)",
}


def _bare(function: object) -> str:
    """The signature without annotations: parameter names, kinds and defaults."""
    parameters = [
        parameter.replace(annotation=inspect.Parameter.empty)
        for parameter in inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    ]
    return str(inspect.Signature(parameters))


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_public_signature(name: str) -> None:
    function = getattr(gradstat, name)
    assert function is getattr(gradstat.clip_grads, name)
    assert _bare(function) == SIGNATURES[name]


def test_private_gtp_pad_zero_count() -> None:
    assert _bare(gradstat.clip_grads._gtp_pad_zero_count) == "(param, grad)"


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = gradstat.nope  # type: ignore[attr-defined]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from gradstat.cli import app\n"
        "try:\n"
        "    app(['--help'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr
    assert "gradstat" in result.stdout


def test_version_from_module_entry_point() -> None:
    result = run_gradstat("--version", timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"gradstat {gradstat.__version__}"


def test_public_names_are_megatrons_api_and_three_of_gradstats_own() -> None:
    own = {"AxisPlace", "GradstatError", "Recorder", "__version__"}
    assert set(gradstat.__all__) == {*gradstat.clip_grads.__all__, *own}
    assert all(getattr(gradstat, name) is not None for name in gradstat.__all__)
    assert "clip_coefficient" not in gradstat.__all__  # gradstat's helper, not Megatron's API
