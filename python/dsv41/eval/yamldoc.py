"""What the matrix and the contract share: each is read from YAML, keeps the text exactly as
given, and is identified by that text's sha256 (recorded before a run starts)."""
from __future__ import annotations

import hashlib

import yaml


class YamlDocument:
    """Mixin for a dataclass with a `text: str` field and a `from_dict(data, source)`."""

    error: type[ValueError] = ValueError  # raised, naming the source, for invalid YAML
    default_source: str = "document"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @classmethod
    def from_yaml(cls, text: str, source: str | None = None):
        source = source or cls.default_source
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise cls.error(f"{source}: not valid YAML: {e}") from None
        except RecursionError:
            raise cls.error(f"{source}: nested too deeply to be a {cls.default_source}") from None
        doc = cls.from_dict(data, source)
        doc.text = text
        return doc
