"""Pydantic models for every request and response of the REST API (shared with the client)."""

from .common import ErrorOut, Id, Version, errors  # noqa: F401
from .coordination import *  # noqa: F403
from .rollout import *  # noqa: F403
from .runs import *  # noqa: F403
from .training import *  # noqa: F403
