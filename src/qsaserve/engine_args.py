"""The engine's command-line flags: one per EngineConfig field, its help text the field's metadata.

Every command that builds an engine (`qsaserve generate|chat|serve|bench|calibrate|qualify`) adds
these; the commands import this module, never each other's, so their CLIs form no import circle.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from qsaserve.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True, help_overrides: dict | None = None) -> None:
    """One flag per EngineConfig field. help_overrides: field -> help text for commands whose default
    differs (e.g. calibrate's --kv-rotation)."""
    overrides = help_overrides or {}
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        if f.name == "model" and not with_model:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        help_text = overrides.get(f.name, f.metadata["help"])
        if "bool" in str(f.type):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
            # Help texts that explain their default already are not given a second one.
            shown = help_text if "default" in help_text else f"{help_text} (default: {default})"
            group.add_argument(flag, type=kind, default=default, help=shown)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
