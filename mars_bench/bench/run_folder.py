"""Which folder a single run writes into, what is refused before Hydra makes one, and what an interrupted
run says.

A single run (no ``-m``) writes into ``output_dir`` where that is set. Otherwise the same command resumes:
the newest *unfinished* run of the same configuration under ``runs/`` is taken up again, so that a run
stopped by Ctrl-C (or killed) goes on where it stopped when its command is given again. Any other run
gets a new folder named for its time, as before: a configuration that has run to its end is measured
again when run again.

- A folder holds *the same configuration* when its ``config.yaml`` (the resolved config, written as the
  cell starts) equals the one composed now, ``progress`` aside.
- It is *unfinished* while it has no ``summary.csv`` (written when the cell has run to its end), its last
  row is not the failure of the whole cell (a model that would not load: a rerun starts afresh instead of
  carrying that row on), and no live process holds its cell claim (a second command beside the first gets
  a folder of its own instead of waiting for it).

Sweeps (``-m``) and SLURM jobs keep ``hydra.sweep.dir``: a sweep resumes when run again into that folder.
"""

from __future__ import annotations

import glob
import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from mars_bench.bench.claims import Claim
from mars_bench.bench.records import RECORDS_FILE, read_rows
from mars_bench.common.files import atomic_replace

CONFIG_FILE = "config.yaml"  # the cell's resolved config, written as it starts: a folder's configuration
CELL_CLAIM = "cell.claim"  # one process writes a cell's folder at a time (bench/claims.py)
# config keys that change neither the rows nor how they are measured: a tuning's table holds other kinds' rows and
# prose; the row a run takes is in its model.dtype and drafter keys
COSMETIC = ("progress", "cpu_tuning")
INTERRUPTED_EXIT = 130  # the shell's status for a process ended by SIGINT (128 + 2)
LAST_ROW_BYTES = 65536  # a whole-cell failure row is far shorter (its error is cut to 2000 characters)


def stored_config(cfg: Any) -> dict[str, Any]:
    """A config as a folder's ``config.yaml`` holds it (resolved, through YAML), less the cosmetic keys."""
    text = OmegaConf.to_yaml(cfg, resolve=True)
    return identity(OmegaConf.to_container(OmegaConf.create(text)))


def identity(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key not in COSMETIC}


def write_config(folder: Path, cfg: Any) -> None:
    """The resolved config, written whole: another command's ``unfinished_run`` may read it at any moment."""
    atomic_replace(folder / CONFIG_FILE, OmegaConf.to_yaml(cfg, resolve=True).encode())


def folder_config(folder: Path) -> dict[str, Any] | None:
    """The configuration ``folder`` was run with, less the cosmetic keys; None where it has none (or an unreadable one)."""
    try:
        return identity(OmegaConf.to_container(OmegaConf.load(folder / CONFIG_FILE)))
    except Exception:  # missing, half-written, from another version: not a folder to resume
        return None


def last_row(path: Path) -> dict[str, Any] | None:
    """The last complete row of a records file, where it is short enough to be a whole-cell failure row."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, handle.seek(0, 2) - LAST_ROW_BYTES))
            lines = handle.read().splitlines(keepends=True)
    except OSError:
        return None
    complete = [line for line in lines if line.endswith(b"\n")]
    try:
        return json.loads(complete[-1]) if complete else None
    except ValueError:  # the tail began inside a long row
        return None


def finished(folder: Path) -> bool:
    """Whether the run in ``folder`` reached its end: its summary is written, or the whole cell failed."""
    from mars_bench.bench.summary import SUMMARY_FILE  # here, not above: the app's refusals need no pandas or scipy

    if (folder / SUMMARY_FILE).exists():
        return True
    row = last_row(folder / RECORDS_FILE)
    return row is not None and row.get("question_id") == "*" and row.get("status") == "failed"


def held(folder: Path) -> bool:
    """Whether a live process holds the cell's claim (it is writing the folder now)."""
    claim = Claim(folder / CELL_CLAIM)
    return claim.path.exists() and not claim.stale()


def last_written(folder: Path) -> float:
    return max((path.stat().st_mtime for path in (folder / RECORDS_FILE, folder / CONFIG_FILE) if path.exists()), default=0.0)


def unfinished_run(root: Path, label: str, config: dict[str, Any]) -> Path | None:
    """The newest unfinished run folder ``root/*/*_label`` of ``config`` (as ``stored_config`` gives it), if any."""
    candidates = [folder for folder in root.glob(f"*/*_{glob.escape(label)}") if (folder / CONFIG_FILE).is_file()]
    runs = [folder for folder in candidates if not finished(folder) and not held(folder) and folder_config(folder) == config]
    return max(runs, key=last_written, default=None)


def choose_run_folder(root: str, stamp: str, label: str, composed: Any) -> str:
    """A single run's folder (``hydra.run.dir``) for the composed config (Hydra's, with its ``hydra`` node)."""
    if composed.output_dir:
        return str(composed.output_dir)
    config = stored_config(OmegaConf.masked_copy(composed, [key for key in composed if key != "hydra"]))
    resumed = unfinished_run(Path(root), label, config)
    if resumed is not None:
        return str(resumed)
    fresh, count = Path(root) / f"{stamp}_{label}", 1
    while fresh.exists():  # a run of the same label started in the same second
        count += 1
        fresh = Path(root) / f"{stamp}-{count}_{label}"
    return str(fresh)


def recorded_cell(folder: Path) -> str | None:
    """The cell name the rows in ``folder`` carry (None before any row): a resumed run keeps it, so that
    one folder's rows name one cell even where the command that resumes it is spelt differently."""
    try:
        with (folder / RECORDS_FILE).open(encoding="utf-8") as handle:
            first = handle.readline()
        return json.loads(first)["cell"] if first.endswith("\n") else None
    except (OSError, ValueError, KeyError):
        return None


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


class CheckBeforeRun(Callback):
    """A single run's values, and its ``output_dir``, checked before Hydra makes the run folder: a run
    refused for a bad value says why in one line (exit 2) and leaves no folder behind. (A sweep's cells
    are checked as each runs: a refused cell is a failure row of the sweep, counted at its end.)"""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        from mars_bench.config.checks import check_run_config

        try:
            check_run_config(config)
            if config.output_dir:
                check_writable(Path(config.output_dir))
        except Exception as error:  # as the cell itself would refuse it: one line, no traceback
            refuse(error)


def refuse(error: BaseException) -> None:
    print(f"mars_bench: error: {error}", file=sys.stderr)
    raise SystemExit(2) from None


def kept_rows(folder: Path) -> int:
    return sum(1 for _ in read_rows(folder / RECORDS_FILE))


def resume_command(argv: list[str], sweep_dir: str | None = None) -> str:
    """The command that resumes this run: the same one, and for a sweep the same one into its folder."""
    words = ["python", "-m", "mars_bench", *argv]
    if sweep_dir is not None and not any(word.startswith("hydra.sweep.dir=") for word in argv):
        words.append(f"hydra.sweep.dir={sweep_dir}")
    return shlex.join(words)


def rows_phrase(count: int) -> str:
    return f"{count} row" if count == 1 else f"{count} rows"


def resuming_line(folder: Path) -> str:
    return f"mars_bench: resuming {folder}: {rows_phrase(kept_rows(folder))} kept (output_dir=NEW_FOLDER starts afresh)"


def interrupted_line(folder: Path | None, command: str) -> str:
    """What an interrupted run says: the rows kept in ``folder`` and the ``command`` that resumes them, or,
    before a cell began there (no folder yet, or one without a config), that nothing was written."""
    if folder is None or not (folder / CONFIG_FILE).is_file():
        return "mars_bench: interrupted before the run began: nothing was written"
    return f"mars_bench: interrupted: {rows_phrase(kept_rows(folder))} kept in {folder}; resume with: {command}"


def remove_if_unused(folder: Path, hydra_files: set[str]) -> None:
    """Remove the run folder ``folder`` where it holds nothing but ``hydra_files`` (Hydra's ``.hydra/`` and the
    job's log): a run stopped before its cell began leaves no folder behind to pile up, nor an empty parent."""
    try:
        names = {path.name for path in folder.iterdir()}
    except OSError:  # gone already, or unreadable: nothing to tidy
        return
    if names <= hydra_files:
        shutil.rmtree(folder, ignore_errors=True)
        try:
            folder.parent.rmdir()  # the day's folder, where this was its only run
        except OSError:
            pass


def register_resolvers() -> None:
    """Register the resolvers conf/config.yaml calls: ``${run_folder:...}`` (``hydra.run.dir``) and
    ``${verifier_label:}`` (``hydra.sweep.subdir``)."""
    from mars_bench.bench.folder_names import register_folder_names

    if not OmegaConf.has_resolver("run_folder"):
        OmegaConf.register_new_resolver("run_folder", run_folder)
    register_folder_names()


def run_folder(root: str, stamp: str, label: str, *, _root_: Any) -> str:
    """``${run_folder:ROOT,STAMP,LABEL}``, the single run's folder (``hydra.run.dir``): ``output_dir`` where
    that is set; else the newest unfinished run of this same configuration under ROOT, resumed; else a new
    ``ROOT/STAMP_LABEL`` (``choose_run_folder``)."""
    return choose_run_folder(root, stamp, label, _root_)
