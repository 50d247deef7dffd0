"""The Hydra app: ``python -m mars_bench [group=option ...] [key=value ...]`` runs one paired
benchmark cell (``-m`` for sweeps) and writes records, manifest and summary into its folder."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from mars_bench.bench.run_folder import register_resolvers
from mars_bench.common.paths import CONF_DIR as CONF_PATH
from mars_bench.config.schema import register_configs

CONF_DIR = str(CONF_PATH)
register_configs()
register_resolvers()


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from mars_bench.bench.run_folder import INTERRUPTED_EXIT, interrupted_line, remove_if_unused, resume_command

    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    folder = Path(cfg.output_dir or hydra_cfg.runtime.output_dir)
    try:
        run(cfg, folder, cell_name(hydra_cfg), multirun)
    except KeyboardInterrupt:  # Ctrl-C: every finished row is on disk, the cell's claim is released
        command = resume_command(sys.argv[1:], hydra_cfg.sweep.dir if multirun else None)
        print(interrupted_line(folder, command), file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT) from None
    finally:
        if not multirun and not cfg.output_dir:  # a folder the app chose, left with only Hydra's files
            remove_if_unused(folder, {str(hydra_cfg.output_subdir), f"{hydra_cfg.job.name}.log"})


def run(cfg: DictConfig, folder: Path, name: str, multirun: bool) -> None:
    """Run the cell into ``folder`` (resuming the rows it holds), then print its summary."""
    from mars_bench.bench.cell import failure_record, run_cell
    from mars_bench.bench.failures import FAILED_EXIT, failure_line
    from mars_bench.bench.manifest import emulated_bf16_warning
    from mars_bench.bench.records import RecordWriter
    from mars_bench.bench.run_folder import CONFIG_FILE, check_writable, recorded_cell, refuse, resuming_line
    from mars_bench.bench.summary import write_summary
    from mars_bench.config.method import configured_spec
    from mars_bench.config.run_line import run_line
    from mars_bench.config.tuning import take_back_tuning

    take_back_tuning(cfg)  # the run as its backend takes it: its first line, the config it writes, its cell
    spec = configured_spec(cfg)  # the cell's method, built once (None: the cell refuses the config, in its own line)
    print(run_line(cfg, spec), flush=True)  # stdout, before the progress bar and the summary
    name = recorded_cell(folder) or name
    try:
        check_writable(folder)
    except OSError as error:
        refuse(error)
    if (folder / CONFIG_FILE).is_file():  # a cell has started here before
        print(resuming_line(folder), file=sys.stderr)
    slow_bf16 = emulated_bf16_warning(cfg.model.get("dtype"), cfg.model.get("device_map"), kernels=cfg.model.kernels)
    if slow_bf16:
        print(f"mars_bench: warning: {slow_bf16}", file=sys.stderr)
    try:
        rows = run_cell(cfg, folder, name=name, spec=spec)
    except Exception as error:  # the cell cannot run (a model that will not load, ...)
        RecordWriter(folder).write(failure_record(cfg, name, spec, error))
        print(f"mars_bench: error: {error}", file=sys.stderr)
        if multirun:
            return  # the sweep goes on; SweepReport counts the failure at the end
        raise SystemExit(2) from None
    print(write_summary(rows, folder, cfg.include_disturbed, cfg.include_cut))
    print(f"records: {folder / 'records.jsonl'}")
    failures = failure_line(rows)
    if failures:
        print(f"mars_bench: {failures}", file=sys.stderr)
        if not multirun:
            raise SystemExit(FAILED_EXIT)


def cell_name(hydra_cfg) -> str:
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith(("hydra.", "output_dir"))]
    return ",".join(overrides) or "default"


def start() -> None:
    """Refuse a misspelt group option, drafter or verifier key, a value of the wrong type, a SLURM sweep
    over targets, or a launcher whose extra is not installed, in one line before Hydra composes the config."""
    from mars_bench.bench.run_folder import INTERRUPTED_EXIT, interrupted_line
    from mars_bench.common.extras import check_launcher
    from mars_bench.config.overrides import (
        check_group_choices,
        check_override_keys,
        check_override_values,
        check_slurm_sweep,
        check_tuning_row,
    )

    try:
        check_group_choices(sys.argv[1:])
        check_override_keys(sys.argv[1:])
        check_override_values(sys.argv[1:])
        check_slurm_sweep(sys.argv[1:])
        check_tuning_row(sys.argv[1:])
        check_launcher(sys.argv[1:])
    except ValueError as error:
        print(f"mars_bench: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        main()
    except KeyboardInterrupt:  # while Hydra composes the config, before main's folder is known
        print(interrupted_line(None, ""), file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT) from None


if __name__ == "__main__":
    start()
