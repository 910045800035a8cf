"""Name -> source format. Adding a format = one module implementing SourceFormat + one line here."""

from __future__ import annotations

from hiddenstates.errors import ConfigError
from hiddenstates.interop.base import SourceFormat
from hiddenstates.interop.fmt_eagle import EagleFormat
from hiddenstates.interop.fmt_modelopt import ModelOptFormat
from hiddenstates.interop.fmt_specforge import SpecForgeFormat
from hiddenstates.interop.fmt_speculators import SpeculatorsFormat

__all__ = ["FORMATS", "get_format"]

FORMATS: dict[str, type[SourceFormat]] = {
    cls.name: cls for cls in (SpeculatorsFormat, SpecForgeFormat, EagleFormat, ModelOptFormat)
}


def get_format(name: str) -> SourceFormat:
    try:
        return FORMATS[name]()
    except KeyError:
        raise ConfigError(f"unknown import format {name!r}; choose one of: {', '.join(FORMATS)}") from None
