"""Reading a snapshot into numbers: per-parameter statistics (stats), shards rebuilt into
tensors (tiles), the diagnostics (audit, compare) and a flight recorder's history."""
