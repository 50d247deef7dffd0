"""The command line's checks before Hydra composes the config: a group option that does not exist, a drafter or
verifier key the chosen one does not take, a value its key's type cannot take, a SLURM sweep over targets; each
refused in one line (Hydra's own messages take many)."""

from __future__ import annotations

from dataclasses import MISSING, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from omegaconf import OmegaConf

from mars_bench.common.paths import CONF_DIR
from mars_bench.config.schema import PLUGIN_GROUPS, RunConfig
from mars_bench.verification import WINDOW, get_verifier


def allowed_keys(group: str) -> str:
    """The keys of a drafter or verifier config node, as an error lists them: the common ones, then
    each plugin's own settings."""
    plugins = PLUGIN_GROUPS[group]
    own = [f"{name}: {' '.join(sorted(item.name for item in keys))}"
           for name in plugins.names() if (keys := fields(plugins.settings_of(name)))]  # fmt: skip
    common = ", ".join(item.name for item in fields(plugins.common))
    return common + (f"; {group} settings: {'; '.join(own)}" if own else "")


def check_override_keys(overrides: list[str]) -> None:
    """Refuse a command-line ``drafter.KEY=...`` or ``verifier.KEY=...`` whose KEY no drafter or verifier
    declares, or that the chosen one does not take (``verifier=exact verifier.theta=0.5``), in one line
    naming the allowed keys (Hydra's own message would not name them)."""
    for override in overrides:
        group, dot, rest = override.lstrip("+~").partition(".")
        key = rest.split("=", 1)[0]
        if not dot or group not in PLUGIN_GROUPS:
            continue
        plugins = PLUGIN_GROUPS[group]
        if key not in plugins.keys():
            raise ValueError(f"{group}.{key} is not a {group} setting: allowed are {allowed_keys(group)}")
        for name in chosen_plugins(group, overrides):
            own = [item.name for item in fields(plugins.settings_of(name))] if name in plugins.names() else None
            if own is not None and key != "name" and key not in common_keys(group, name) and key not in own:
                allowed = [*common_keys(group, name), *own]
                words = f"allowed are {', '.join(allowed)}" if allowed else f"{group}={name} takes no settings"
                raise ValueError(f"{group}.{key} is not a setting of {group}={name}: {words}")


def common_keys(group: str, name: str) -> list[str]:
    """The keys of the group's common node that plugin ``name`` takes besides its name: every one, except the
    exact-first window of a lossless verifier (which is lossless at every token already)."""
    keys = [item.name for item in fields(PLUGIN_GROUPS[group].common) if item.name != "name"]
    return [key for key in keys if not (group == "verifier" and key == WINDOW and get_verifier(name).lossless)]


def chosen_plugins(group: str, overrides: list[str]) -> list[str]:
    """The ``group`` options (verifiers, drafters) a command line runs: its ``group=...`` values, else the
    chosen experiment's ``override /group``, else conf/config.yaml's default; empty where it cannot tell."""
    choices = [value for override in parsed_overrides(overrides) if override.key_or_group == group
               for value in override_values(override)]  # fmt: skip
    if choices:
        return [str(value) for value in choices]
    experiments = [value for override in parsed_overrides(overrides) if override.key_or_group == "experiment"
                   for value in override_values(override)]  # fmt: skip
    for experiment in experiments:
        if (chosen := default_choice(CONF_DIR / "experiment" / f"{experiment}.yaml", f"override /{group}")) is not None:
            return [chosen]
    default = default_choice(CONF_DIR / "config.yaml", group)
    return [] if default is None else [default]


def default_choice(path: Path, entry: str) -> str | None:
    """The option a config file's defaults list gives ``entry`` (``verifier``, ``override /verifier``), or None."""
    if not path.is_file():
        return None
    for item in OmegaConf.load(path).get("defaults", []) or []:
        if isinstance(item, dict) or OmegaConf.is_dict(item):
            for name, value in dict(item).items():
                if name == entry and value is not None:
                    return str(value)
    return None


ELSEWHERE = ("-cd", "--config-dir", "-cp", "--config-path", "-cn", "--config-name")  # flags that read other configs


def parsed_overrides(argv: list[str]) -> list[Any]:
    """The command line's overrides as Hydra parses them; a word Hydra cannot parse (or a flag's value) is
    left out, for Hydra itself to report."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser, parsed = OverridesParser.create(), []
    for word in argv:
        if word.startswith("-"):
            continue
        try:
            parsed += parser.parse_overrides([word])
        except HydraException:
            continue
    return parsed


def override_values(override: Any) -> list[Any]:
    """The values an override sets: one, or each of a choice sweep's (none for ranges, globs and deletions)."""
    from hydra.core.override_parser.types import ValueType

    if override.is_delete():
        return []
    if override.value_type == ValueType.ELEMENT:
        return [override.value()]
    if override.value_type in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
        return list(override.sweep_iterator())
    return []


def group_options(roots: list[Path]) -> dict[str, list[str]]:
    """Each config group below the config folders ``roots`` (``<root>/<group>/<option>.yaml``), with its options."""
    options: dict[str, set[str]] = {}
    for root in roots:
        for path in root.glob("*/*.yaml"):
            options.setdefault(path.parent.name, set()).add(path.stem)
    options.pop("hydra", None)  # Hydra's own groups (hydra/launcher: mars_bench.common.extras.check_launcher)
    return {group: sorted(names) for group, names in options.items()}


def search_folders(entries: list[str]) -> list[Path]:
    """The folders of ``hydra.searchpath`` entries (``file://FOLDER``)."""
    return [Path(entry.removeprefix("file://")) for entry in entries]


def check_group_choices(argv: list[str]) -> None:
    """Refuse a command-line ``group=option`` whose group has no such option, in one line with the closest
    option (Hydra's own message lists every option over many lines). The groups are the folders of
    ``conf/`` and of a ``hydra.searchpath`` folder; a command that reads configs from elsewhere (``-cd``,
    ``-cp``, ``-cn``, a search path that is not a folder) is left to Hydra."""
    import difflib

    if any(word.split("=", 1)[0] in ELSEWHERE for word in argv):
        return
    overrides = parsed_overrides(argv)
    roots = [CONF_DIR]
    for override in overrides:
        for value in override_values(override) if override.key_or_group == "hydra.searchpath" else []:
            entries = [str(entry) for entry in (value if isinstance(value, list) else [value])]
            if not all(entry.startswith("file://") for entry in entries):
                return
            roots += search_folders(entries)
    options = group_options(roots)
    for override in overrides:
        group = override.key_or_group
        for choice in override_values(override) if group in options else []:
            if choice is not None and str(choice) not in options[group]:
                close = difflib.get_close_matches(str(choice), options[group], n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(f"{group}={choice} is not a {group} option{hint}: allowed are {', '.join(options[group])}")


def declared_types(key: str, argv: list[str]) -> list[Any]:
    """The types the config leaf ``key`` is declared with (``max_new_tokens``: ``int``): a drafter's or verifier's
    key has the type each plugin the command line ``argv`` chooses gives it (``verifier=fsd verifier.threshold``:
    fsd's ``float``; a sweep over plugins, each one's; a key every plugin takes where none chosen is registered,
    the common type). Empty where no type is declared (a group, a key inside a free-form value, an unknown key)."""
    nodes: list[Any] = [RunConfig]
    for depth, part in enumerate(key.split(".")):
        nodes = [hints[part] for node in nodes if is_dataclass(node) and part in (hints := get_type_hints(node))]
        if depth == 0 and part in PLUGIN_GROUPS:
            plugins = PLUGIN_GROUPS[part]
            nodes = [plugins.schema(name) for name in chosen_plugins(part, argv) if name in plugins.names()] or [plugins.common]
    return [hint for index, hint in enumerate(nodes) if not is_dataclass(hint) and hint not in nodes[:index]]


def allowed_values(hint: Any) -> str:
    """What a value of type ``hint`` may be, as the command line writes it."""
    members = [member for member in get_args(hint) if member is not type(None)] if get_origin(hint) in UNIONS else [hint]
    words = {float: "a number", int: "an integer", bool: "true or false", str: "a string", list: "a list [a,b]",
             dict: "a mapping {key:value}"}  # fmt: skip
    text = " or ".join(words.get(get_origin(member) or member, str(member)) for member in members)
    return text + (" or null" if type(None) in get_args(hint) else "")


UNIONS = (Union, UnionType)


def check_override_values(argv: list[str]) -> None:
    """Refuse a command-line ``key=value`` whose value the key's declared type cannot take (``verifier.theta=abc``)
    in one line naming the key, the value and what is allowed (OmegaConf's own message takes several lines).
    The type is checked as Hydra will check it, by assigning the value to a structured node of that type."""
    from omegaconf.errors import ValidationError

    for override in parsed_overrides(argv):
        for hint in declared_types(override.key_or_group, argv):
            if hint is Any:
                continue
            probe = OmegaConf.structured(make_dataclass("Probe", [("value", hint, field(default=MISSING))]))
            for value in override_values(override):
                try:
                    probe.value = value
                except ValidationError:
                    shown = value if override.is_sweep_override() else override.input_line.split("=", 1)[1]  # as typed
                    raise ValueError(f"{override.key_or_group}={shown} is invalid: allowed is {allowed_values(hint)}") from None


def check_tuning_row(argv: list[str]) -> None:
    """Refuse a typed ``tuned_for=KIND`` that names no CPU kind (``common/cpu.py``), in one line: the embedded
    tuning's table has a row for each, and its interpolation would otherwise fail inside Hydra's composition."""
    from mars_bench.common.cpu import CPU_KINDS, OTHER_KIND

    kinds = (*CPU_KINDS, OTHER_KIND)
    for override in parsed_overrides(argv):
        if override.key_or_group == "tuned_for":
            for value in override_values(override):
                if value not in kinds:
                    raise ValueError(f"tuned_for={value} is invalid: allowed is one of {', '.join(kinds)}")


def check_slurm_sweep(overrides: list[str]) -> None:
    """Refuse, in one line, a sweep over ``model`` or ``model.resources.*`` under ``hydra/launcher=slurm``:
    Hydra sizes every job of a sweep from one composition, so each target would get the first one's
    GPUs and memory. One sweep per target is right (the Table 1 recipe in docs/clusters.md)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("-")])
    except HydraException:
        return  # Hydra itself reports a malformed override
    if not any(o.key_or_group == "hydra/launcher" and o.value() == "slurm" for o in parsed):
        return
    for override in parsed:
        key = override.key_or_group
        if override.is_sweep_override() and (key == "model" or key.startswith("model.resources")):
            raise ValueError(
                f"{override.input_line} under hydra/launcher=slurm: every job of a sweep is sized from one "
                f"composition, so these jobs would not get their own resources; allowed is one value of {key} "
                "per sweep (run the command once for each)"
            )
