"""The run's parameter-server keys, for the trainer, the PS and the rollout instances
(workers/trainer/param_auth.py; docs/security.md)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from staleflow_db import param_keys
from workers.wire.enums import Role
from workers.wire.models import ParamSecretOut, errors

from ..auth import Principal, ps_keys
from ..deps import RunId, State, allow_run

router = APIRouter(prefix="/v1/runs/{run_id}", responses=errors(401, 403, 404))


@router.get("/param-secret", response_model=ParamSecretOut, tags=["training"])
def param_secret(
    run_id: RunId, state: State, who: Principal = Depends(allow_run(Role.TRAINER, Role.ROLLOUT))
) -> ParamSecretOut:
    """The run's parameter-server keys for this token's role: a rollout token gets the rollout
    key (pull), a trainer or admin token the trainer key (push, commit) and the rollout key."""
    secret = param_keys.run_secret(state.engine, run_id)
    return ParamSecretOut(run_id=run_id, keys=ps_keys(secret, run_id, who.role))
