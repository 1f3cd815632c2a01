"""How every Tandem command's ``--help`` reads: each flag with its default.

Owns ``DefaultsHelpFormatter``, given as ``formatter_class`` to every parser and subparser
(``tandem``, ``tandem serve``, the gateway, the picker, ``tandem render``). It does not own
any flag.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help, as ``ArgumentDefaultsHelpFormatter`` does,
    but not where the help already says its default in words, nor for an unset (None) or
    off (False) default, which would only print ``None`` or ``False``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text or default is argparse.SUPPRESS
                or default is None or default is False or default in ([], {})):
            return action.help
        return f"{text} (default: %(default)s)".lstrip()
