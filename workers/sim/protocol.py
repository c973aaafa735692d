"""The reference protocol as the simulator uses it: `ReferenceProtocol` itself (its reward
claims scan only the samples that finished, so paper-scale runs stay linear)."""

from __future__ import annotations

from staleflow_db.reference import ReferenceProtocol

SimProtocol = ReferenceProtocol
