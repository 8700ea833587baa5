"""``--help`` that shows every default, for bdnctl, bdn-publish and
``python -m bdn.engines`` (bdnd writes its own, with each key's variable).

argparse's ArgumentDefaultsHelpFormatter also prints ``(default: None)`` and ``(default:
False)`` for options that have no default worth saying; this one appends ``(default: X)`` only
when there is one and the help text does not already say it, and keeps descriptions and
epilogs as written (RawDescriptionHelpFormatter).
"""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Help text with ``(default: X)`` after every option that has a default to tell."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is False
            or default == []
            or default == ""
            or default is argparse.SUPPRESS
            or text is argparse.SUPPRESS
            or "default" in text
        ):
            return action.help
        shown = ":".join(map(str, default)) if isinstance(default, tuple) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"
