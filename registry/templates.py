"""Which language a model's template is written in: Ollama's Go templates, which mlxd renders per
request, or Jinja, which the model's tokenizer is loaded with."""

from __future__ import annotations

import re

__all__ = ["is_go_template", "loaded_template"]

_GO_FIELD = re.compile(r"{{[^}]*?(?<![\w\])])\.[A-Z]")


def is_go_template(template: str) -> bool:
    """Ollama's Go templates name fields (`{{ .Prompt }}`); anything else is Jinja, as the chat
    template `/api/show` reports, which /api/generate's `template` therefore also takes."""
    return bool(_GO_FIELD.search(template))


def loaded_template(template: str | None) -> str | None:
    """The part of a model's template that its loaded tokenizer holds: a Jinja one; None for
    none or Ollama's Go (rendered per request, so entries differing only in it share a load)."""
    return template if template and not is_go_template(template) else None
