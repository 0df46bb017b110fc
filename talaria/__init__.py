"""Talaria: session-aware serverless multi-model serving for tool-using LLM agents.

One import root. The repository keeps its top-level folders (`shared/`, `services/`,
`migrations/`, `ops/`) as the design lays them out; the wheel installs them as
`talaria.shared`, `talaria.services`, `talaria.migrations` and `talaria.ops` (setuptools
package-dir mapping in pyproject.toml). In a checkout the same names resolve because the
repository root is part of this package's search path.
"""

from pathlib import Path as _Path

__version__ = "0.1.0"

_CHECKOUT = _Path(__file__).resolve().parent.parent
if (_CHECKOUT / "shared" / "__init__.py").is_file() and not (_Path(__file__).parent / "shared").exists():
    __path__.append(str(_CHECKOUT))  # noqa: F821 - a package's __path__ is defined by the import system
