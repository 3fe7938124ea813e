"""Settings shared by the OpenAI-compatibility and client-library tests."""

from __future__ import annotations

import os

# litellm fetches a model cost map from the network at import unless told to use its own copy.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
