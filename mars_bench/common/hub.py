"""Whether to ask the Hugging Face Hub, decided once per process, for the task providers and model resolution.

Without a network the hub libraries retry each request five times with backoff: over 20 s and eleven
lines of warnings before a task falls back to its pinned package. Instead, the first caller probes the Hub once,
with a short timeout. Where nothing answers, one line says so and the process goes on in the libraries'
offline mode (as under ``HF_HUB_OFFLINE=1``): their caches still serve, and everything else falls back at
once. Under ``HF_HUB_OFFLINE=1`` nothing is probed and nothing printed.
"""

from __future__ import annotations

import functools
import os
import sys

PROBE_TIMEOUT_S = 5.0
FALLBACK = "prompts and models fall back to their pinned registry packages, and this run asks the Hub no more"


def hub_online() -> bool:
    """Whether the Hub may be asked: False in offline mode (set, or after a probe that got no answer),
    else whether this process's one probe got an answer."""
    from huggingface_hub import constants

    return not constants.is_offline_mode() and hub_answers()


@functools.cache
def hub_answers() -> bool:
    """One request to the Hub's endpoint (``$HF_ENDPOINT`` or huggingface.co) through the hub libraries'
    own HTTP session, so their proxies and certificates apply; any HTTP answer, an error status included,
    counts as reachable. Without one: the line on stderr, offline mode for the process, and False."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=PROBE_TIMEOUT_S)
    except Exception as error:  # refused, unresolved, timed out, a proxy's refusal: no answer from the Hub
        print(unreachable_line(constants.ENDPOINT, error), file=sys.stderr)
        go_offline()
        return False
    return True


def unreachable_line(endpoint: str, error: BaseException) -> str:
    """The one line a run without the Hub prints."""
    return f"mars_bench: the Hugging Face Hub ({endpoint}) could not be reached ({type(error).__name__}); {FALLBACK}"


def go_offline() -> None:
    """The hub libraries' offline mode for the rest of this process and the processes it starts."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"  # child processes, and datasets where it is imported later
    constants.HF_HUB_OFFLINE = True  # huggingface_hub and transformers read it on every request
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:  # datasets copied the setting when it was imported
        datasets_config.HF_HUB_OFFLINE = datasets_config.HF_DATASETS_OFFLINE = True
