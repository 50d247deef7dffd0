"""The Hydra app: ``python -m mars_bench [group=option ...] [key=value ...]`` runs one paired
benchmark cell (``-m`` for sweeps) and writes records, manifest and summary into its folder."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from mars_bench.config import register_configs
from mars_bench.paths import CONF_DIR as CONF_PATH

CONF_DIR = str(CONF_PATH)
register_configs()


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from mars_bench.bench.cell import failure_record, run_cell
    from mars_bench.bench.failures import FAILED_EXIT, failure_line
    from mars_bench.bench.records import RecordWriter
    from mars_bench.bench.summary import write_summary

    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    folder = Path(cfg.output_dir or hydra_cfg.runtime.output_dir)
    name = cell_name(hydra_cfg)
    try:
        check_writable(folder)
    except OSError as error:
        print(f"mars_bench: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        rows = run_cell(cfg, folder, name=name)
    except Exception as error:  # the cell cannot run (bad input, a model that will not load, ...)
        RecordWriter(folder).write(failure_record(cfg, name, error))
        print(f"mars_bench: error: {error}", file=sys.stderr)
        if multirun:
            return  # the sweep goes on; SweepReport counts the failure at the end
        raise SystemExit(2) from None
    print(write_summary(rows, folder, cfg.include_disturbed))
    print(f"records: {folder / 'records.jsonl'}")
    failures = failure_line(rows)
    if failures:
        print(f"mars_bench: {failures}", file=sys.stderr)
        if not multirun:
            raise SystemExit(FAILED_EXIT)


def cell_name(hydra_cfg) -> str:
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith(("hydra.", "output_dir"))]
    return ",".join(overrides) or "default"


def check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise OSError(
            f"output folder {str(folder)!r} cannot be written ({error.strerror}); allowed is a writable folder"
        ) from None


def start() -> None:
    """Refuse a misspelt drafter or verifier key, a SLURM sweep over targets, or a launcher whose extra is
    not installed, in one line before Hydra composes the config."""
    from mars_bench.config import check_override_keys, check_slurm_sweep
    from mars_bench.extras import check_launcher

    try:
        check_override_keys(sys.argv[1:])
        check_slurm_sweep(sys.argv[1:])
        check_launcher(sys.argv[1:])
    except ValueError as error:
        print(f"mars_bench: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    main()


if __name__ == "__main__":
    start()
