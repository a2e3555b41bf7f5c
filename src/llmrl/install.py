"""How to install one of llmrl's optional extras, said the way that works where llmrl came from: llmrl is not on the
package index, so a source checkout (an editable install) needs `pip install -e ".[extra]"` from the checkout's root;
an installed wheel keeps `pip install "llmrl[extra]"`."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import unquote, urlparse


def source_checkout() -> Path | None:
    """The root of the source checkout this llmrl runs from (its pyproject.toml two levels above the package, or an
    editable install's direct_url.json), or None when llmrl is an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    try:
        if 'name = "llmrl"' in (root / "pyproject.toml").read_text(encoding="utf-8"):
            return root
    except (OSError, ValueError):
        pass
    try:
        from importlib.metadata import distribution

        info = json.loads(distribution("llmrl").read_text("direct_url.json") or "{}")
    except Exception:  # noqa: BLE001 - no metadata, or unreadable: not known to be editable
        return None
    url = info.get("url", "") if isinstance(info, dict) else ""
    if (info.get("dir_info") or {}).get("editable") and url.startswith("file://"):
        return Path(unquote(urlparse(url).path))
    return None


def pip_install(extra: str) -> str:
    """The command that installs llmrl's optional extra `extra` here."""
    root = source_checkout()
    return f'pip install "llmrl[{extra}]"' if root is None else f'pip install -e ".[{extra}]" from {root}'
