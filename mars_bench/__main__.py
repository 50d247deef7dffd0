"""The Hydra app: ``python -m mars_bench [group=option ...] [key=value ...]`` runs one paired
benchmark cell (``-m`` for sweeps) and writes records, manifest and summary into its folder."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mars_bench.config import register_configs

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()


class RunError(Exception):
    """Bad input found at run time; reported as one line."""


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from mars_bench.bench.cell import run_cell
    from mars_bench.bench.summary import write_summary
    from mars_bench.sources import SourceError

    hydra_cfg = HydraConfig.get()
    folder = Path(cfg.output_dir or hydra_cfg.runtime.output_dir)
    try:
        check_writable(folder)
        rows = run_cell(cfg, folder, name=cell_name(hydra_cfg))
    except (ValueError, SourceError, OSError) as error:
        print(f"mars_bench: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(write_summary(rows, folder))
    print(f"records: {folder / 'records.jsonl'}")


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


if __name__ == "__main__":
    main()
