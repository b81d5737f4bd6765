"""The omnistage stage services: one sub-package per service; none imports another.

Importing this package is the first thing a service process (`python -m omnistage.services.<kind>`)
does: it ties the process to its launcher before any slow import (common/runtime/orphan.py).
"""

from omnistage.common.runtime.orphan import die_with_launcher

die_with_launcher()
