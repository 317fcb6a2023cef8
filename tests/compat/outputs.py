"""``ModelRunnerOutput`` as the installed vLLM defines it: the one place that knows its fields differ by version.

vLLM 0.32 and 0.33 require ``req_id_to_index`` (request id -> row); 0.34 removed it (rows follow ``req_ids``).
Used by the conformance test's runner (``tests/compat/harness.py``) and by the unit tests that feed vLLM's
``KVOutputAggregator`` (``tests/unit/connector/test_plugin.py``, ``test_ranks_properties.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from vllm.v1.outputs import ModelRunnerOutput

HAS_REQ_ID_TO_INDEX = any(f.name == "req_id_to_index" for f in dataclasses.fields(ModelRunnerOutput))


def model_runner_output(req_ids: Sequence[str] = (), sampled: Sequence[list[int]] | None = None) -> Any:
    """A runner's answer for ``req_ids`` (``sampled``: the tokens of each, in order; none by default)."""
    kwargs: dict[str, Any] = {"req_ids": list(req_ids), "sampled_token_ids": [list(t) for t in sampled or ()]}
    if HAS_REQ_ID_TO_INDEX:
        kwargs["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(**kwargs)
