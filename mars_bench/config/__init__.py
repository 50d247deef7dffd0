"""The run's configuration: the Hydra schema (``schema``), the command line's checks before Hydra composes it
(``overrides``), the method it names (``method``), the drafter tuning as a backend takes it (``tuning``), the run's
first line (``run_line``) and the checks of a composed config before any model loads (``checks``)."""
