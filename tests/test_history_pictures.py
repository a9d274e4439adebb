"""``gradstat history --plot`` and ``--tensorboard``: a real PNG and SVG of a recorded run, and
event files whose series TensorBoard's own reader gives back equal to the float64 statistics
of the gradients planted; nothing a user owns overwritten; a missing extra named."""

from __future__ import annotations

import math
import subprocess
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import gradstat
from gradstat.cli import app
from tests._cli import run_gradstat, run_python
from tests._oracle import float64_norm, zeros_in

SPIKE_AT, MISMATCH_AT, NAN_AT, STEPS = 5, 7, 10, 12
EVERY = 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNG_SHAPE = (750, 1200, 4)  # height, width, RGBA
NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")


@dataclass(frozen=True)
class Run:
    root: Path
    grads: dict[int, dict[str, torch.Tensor]]  # step: each parameter's gradient, as recorded
    logged: dict[int, float]  # step: the norm the loop said it logged (none at NAN_AT)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A recorded loop: the first weight spikes at SPIKE_AT, the loop logs a wrong norm at
    MISMATCH_AT, the last weight holds a NaN at NAN_AT; a snapshot every EVERY steps."""
    root = tmp_path_factory.mktemp("run")
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    recorder = gradstat.Recorder(model, root, every=EVERY, keep=100, spike=None)
    inputs = torch.randn(16, 6)
    grads, logged = {}, {}
    for step in range(1, STEPS + 1):
        model.zero_grad()
        model(inputs).square().mean().backward()
        params = dict(model.named_parameters())
        if step == SPIKE_AT:
            params["0.weight"].grad.mul_(1000.0)
        if step == NAN_AT:
            params["2.weight"].grad[0, 0] = math.nan
        grads[step] = {name: param.grad.clone() for name, param in params.items()}
        exact = float64_norm(grads[step].values(), 2)
        if step != NAN_AT:
            logged[step] = 2 * exact if step == MISMATCH_AT else exact
        recorder.step(step, logged.get(step))
    recorder.wait()
    return Run(root, grads, logged)


def _history(run: Run, *args: str) -> subprocess.CompletedProcess[str]:
    return run_gradstat("history", str(run.root), *args)


def test_the_plot_is_a_png_of_the_run(run: Run, tmp_path: Path) -> None:
    from matplotlib.image import imread

    png = tmp_path / "history.png"
    result = _history(run, "--plot", str(png))
    assert result.returncode == 1, result.stderr  # a parameter went NaN: findings
    assert "0.weight" in result.stdout  # the table is still printed
    assert png.read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC
    pixels = torch.from_numpy(imread(png))
    assert tuple(pixels.shape) == PNG_SHAPE
    assert float(pixels[..., :3].std()) > 0.05, "not blank"
    # The NaN step is a red line across the axes: a column with hundreds of red pixels, where
    # a parameter's line crosses each column in a few.
    red, green, blue = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    reddish = (red > 0.75) & (green < 0.45) & (blue < 0.45)
    assert int(reddish.sum(dim=0).max()) > PNG_SHAPE[0] // 2
    assert sorted(path.name for path in tmp_path.iterdir()) == ["history.png"]


def _svg_texts(svg: Path) -> tuple[str, list[str]]:
    """The root element's tag and the texts of the figure."""
    root = ElementTree.parse(svg).getroot()
    texts = [
        "".join(element.itertext()) for element in root.iter("{http://www.w3.org/2000/svg}text")
    ]
    return root.tag, texts


def test_the_svg_names_each_first_jump_and_the_marked_steps(run: Run, tmp_path: Path) -> None:
    svg = tmp_path / "history.svg"
    result = _history(run, "--plot", str(svg), "--top", "3")
    assert result.returncode == 1, result.stderr
    tag, texts = _svg_texts(svg)
    assert tag == "{http://www.w3.org/2000/svg}svg"
    # The one that moved first leads; the NaN is a jump; the rest fill --top by peak norm.
    jumps = [text for text in texts if " at " in text and ":" in text]
    assert jumps[:2] == [f"0.weight: norm at {SPIKE_AT}", f"2.weight: nonfinite at {NAN_AT}"]
    snapshots = sorted(path.name for path in run.root.glob("step-*"))
    assert len(snapshots) >= STEPS // EVERY + 1  # every EVERY steps, and the NaN's
    assert f"snapshot ({len(snapshots)} steps)" in texts
    assert "mismatch trigger (1 step)" in texts
    assert "total NaN or Inf (1 step)" in texts
    shown = [name for name in NAMES if any(text.startswith(f"{name}") for text in texts)]
    assert len(shown) == 3
    assert f"gradstat history of {run.root}" in texts  # the title's two lines
    assert any(text.startswith(f"from its telemetry log: {STEPS} steps") for text in texts)


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series as TensorBoard reads it back: tag -> (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def _same(values: list[tuple[int, float]], expected: dict[int, float]) -> None:
    """The series holds ``expected``'s steps and values, within float32's rounding."""
    assert [step for step, _ in values] == sorted(expected)
    for step, value in values:
        want = expected[step]
        if math.isnan(want):
            assert math.isnan(value), step
        else:
            assert math.isclose(value, want, rel_tol=2e-7, abs_tol=1e-30), (step, value, want)


def test_tensorboard_reads_back_the_planted_statistics(run: Run, tmp_path: Path) -> None:
    board = tmp_path / "board" / "run"
    result = _history(run, "--tensorboard", str(board))
    assert result.returncode == 1, result.stderr
    scalars = _scalars(board)
    per_param = {
        f"{kind}/{name}" for kind in ("grad_norm", "max_abs", "num_zeros") for name in NAMES
    }
    assert set(scalars) == {"total/grad_norm", "total/logged_norm", "total/num_zeros", *per_param}
    steps = range(1, STEPS + 1)
    grads = run.grads
    _same(scalars["total/grad_norm"], {s: float64_norm(grads[s].values(), 2) for s in steps})
    _same(scalars["total/num_zeros"], {s: zeros_in(grads[s].values()) for s in steps})
    _same(scalars["total/logged_norm"], run.logged)
    assert NAN_AT not in dict(scalars["total/logged_norm"])
    for name in NAMES:
        _same(scalars[f"grad_norm/{name}"], {s: float64_norm([grads[s][name]], 2) for s in steps})
        _same(scalars[f"num_zeros/{name}"], {s: zeros_in([grads[s][name]]) for s in steps})
        largest = {s: float(grads[s][name].double().abs().max()) for s in steps}
        _same(scalars[f"max_abs/{name}"], largest)
    assert math.isnan(dict(scalars["grad_norm/2.weight"])[NAN_AT])
    spiked = dict(scalars["grad_norm/0.weight"])
    assert spiked[SPIKE_AT] > 100 * spiked[SPIKE_AT - 1]


def _refused(args: list[str]) -> str:
    """Run ``gradstat`` in this process; the one line it refused with (exit 2, no stdout)."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.endswith("\n") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr.removeprefix("gradstat: error: ").removesuffix("\n")


def test_an_existing_plot_file_is_left_as_it_is(run: Run, tmp_path: Path) -> None:
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"the user's own picture\n")
    line = _refused(["history", str(run.root), "--plot", str(mine)])
    assert line == f"--plot {mine}: exists; remove it or choose another name"
    assert mine.read_bytes() == b"the user's own picture\n"
    assert list(tmp_path.iterdir()) == [mine]


@pytest.mark.parametrize(
    ("plot", "board_holds", "message"),
    [
        ("history.jpg", None, "unknown suffix '.jpg'; name a .png or .svg file"),
        ("history", None, "unknown suffix '(none)'; name a .png or .svg file"),
        ("history.png", "events", "exists and is not empty; remove it or choose another directory"),
    ],
)
def test_a_bad_target_is_refused_before_anything_is_written(
    run: Run, tmp_path: Path, plot: str, board_holds: str | None, message: str
) -> None:
    board = tmp_path / "board"
    if board_holds is not None:
        board.mkdir()
        (board / board_holds).write_text("earlier\n")
    line = _refused(
        ["history", str(run.root), "--plot", str(tmp_path / plot), "--tensorboard", str(board)]
    )
    assert line.endswith(message) and str(tmp_path) in line
    left = sorted(path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("*"))
    assert left == ([] if board_holds is None else ["board", f"board/{board_holds}"])


@pytest.mark.parametrize(
    ("module", "option", "target"),
    [("matplotlib", "--plot", "history.png"), ("tensorboard", "--tensorboard", "board")],
)
def test_a_missing_extra_is_named(
    run: Run, tmp_path: Path, module: str, option: str, target: str
) -> None:
    # A process of its own where the module cannot be imported, as in an install without the
    # extra (the fork server has not imported it either).
    argv = ["gradstat", "history", str(run.root), option, str(tmp_path / target)]
    script = (
        f"import sys; sys.modules[{module!r}] = None; sys.argv = {argv!r}; "
        "from gradstat.cli import main; main()"
    )
    result = run_python(script)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        f"gradstat: error: {option} needs {module}: pip install 'gradstat[plot]'\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_norms_near_float64s_ends_are_drawn_without_a_warning(tmp_path: Path) -> None:
    """float64 gradients of 1e300 and 1e-46: matplotlib's log scale overflowed, and numpy's
    RuntimeWarning (two lines of source) went to stderr beside the figure."""
    weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    recorder = gradstat.Recorder([("weight", weight)], tmp_path / "run", spike=None)
    for step, scale in enumerate((1e300, 1e-46, 1e150, 1.0), 1):
        weight.grad = torch.full((4,), scale, dtype=torch.float64)
        recorder.step(step)
    recorder.wait()
    png = tmp_path / "history.png"
    result = run_gradstat("history", str(tmp_path / "run"), "--plot", str(png))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert png.read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC
