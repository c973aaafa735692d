"""Pydantic models for every request and response of the REST API (shared with the client)."""

from .common import DropsOut as DropsOut
from .common import ErrorOut as ErrorOut
from .common import Id as Id
from .common import Version as Version
from .common import errors as errors
from .coordination import *  # noqa: F403
from .lineage import *  # noqa: F403
from .node import *  # noqa: F403
from .rollout import *  # noqa: F403
from .runs import *  # noqa: F403
from .training import *  # noqa: F403
