"""Pydantic models for every request and response of the REST API (shared with the client)."""

from .coordination import *  # noqa: F401,F403
from .rollout import *  # noqa: F401,F403
from .runs import *  # noqa: F401,F403
from .training import *  # noqa: F401,F403
from .common import ErrorOut, Id, Version, errors  # noqa: F401
