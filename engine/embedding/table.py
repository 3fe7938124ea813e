"""What the embedding models people pull need and their files often forget.

Converted `mlx-community/*` repos drop sentence-transformers' `1_Pooling/` and
`config_sentence_transformers.json`, and the encoders share architectures whose pooling differs
(bge-m3, mxbai and arctic pool the CLS token where all-MiniLM and nomic average), so pooling and
the query/document prefixes are kept here, matched on the model's name.
"""

from __future__ import annotations

from dataclasses import dataclass

CLS = "cls"
MEAN = "mean"
LAST = "last"
POOLINGS = (CLS, MEAN, LAST)

QWEN3_QUERY = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)
REPRESENT_QUERY = "Represent this sentence for searching relevant passages: "


@dataclass(frozen=True)
class KnownModel:
    """One family of embedding models, found by a fragment of its name (lower case)."""

    match: str
    pooling: str
    query_prefix: str = ""
    document_prefix: str = ""
    max_length: int | None = None  # tokens the model was trained on, when below its config's


# First match wins: the more specific fragments come first.
KNOWN_MODELS: tuple[KnownModel, ...] = (
    KnownModel("nomic-embed-text", MEAN, "search_query: ", "search_document: ", 8192),
    KnownModel("bge-m3", CLS, max_length=8192),
    KnownModel("mxbai-embed-large", CLS, REPRESENT_QUERY, max_length=512),
    KnownModel("all-minilm", MEAN, max_length=256),
    KnownModel("snowflake-arctic-embed-l-v2", CLS, "query: ", max_length=8192),
    KnownModel("snowflake-arctic-embed-m-v2", CLS, "query: ", max_length=8192),
    KnownModel("snowflake-arctic-embed", CLS, REPRESENT_QUERY, max_length=512),
    KnownModel("qwen3-embedding", LAST, QWEN3_QUERY, max_length=8192),
)


def known_model(*names: str) -> KnownModel | None:
    """The table's row for the first of `names` (entry name, repo id, directory, the config's
    `_name_or_path`) that one of its fragments matches."""
    for name in names:
        low = name.lower().replace("_", "-")
        for row in KNOWN_MODELS:
            if row.match in low:
                return row
    return None
