"""Wake-ups between processes: the one place the NOTIFY payload is built, sent and parsed.

On channel ``staleflow`` a payload ``<sender>|<run>|<topic,topic>`` says that the run changed
for waiters of those topics (ENGINEERING pattern 7). The API's notifier sends and hears them;
writers outside the API (the coordinator service) send them with sender ``-``. A NOTIFY takes
a global lock at commit, so it is sent in its own statement, never inside a protocol
transaction; a lost one costs latency (waiters re-check on a timer), never correctness.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection

from . import queries

CHANNEL = "staleflow"  # as the named query `listen` says

# Topics: what a waiter is waiting for.
WORK = "work"  # routes and commands for instances
REWARDS = "rewards"  # finished samples to score
BATCH = "batch"  # buffers that may have become ready
TOPICS = (WORK, REWARDS, BATCH)

OUTSIDE = "-"  # the sender id of writers outside the API: every replica heeds them
MOST_TOPICS = 64  # NOTIFY payloads are limited (8000 bytes): more subtopics collapse into their parent


def instance_topic(instance_id: int) -> str:
    """The subtopic of one instance's work: `work` wakes it too."""
    return f"{WORK}:{instance_id}"


@dataclass(frozen=True)
class Wakeup:
    sender: str
    run_id: int
    topics: tuple[str, ...]

    @classmethod
    def of(cls, sender: str, run_id: int, topics: Iterable[str]) -> Wakeup:
        """Topics sorted; over MOST_TOPICS of them, only their parents."""
        unique = set(topics)
        if len(unique) > MOST_TOPICS:
            unique = {t.split(":")[0] for t in unique}
        return cls(sender, run_id, tuple(sorted(unique)))

    def payload(self) -> str:
        return f"{self.sender}|{self.run_id}|{','.join(self.topics)}"

    @classmethod
    def parse(cls, payload: str) -> Wakeup | None:
        """None for a malformed payload. Unknown topics are dropped; none left means all."""
        try:
            sender, run, topics = payload.split("|", 2)
            run_id = int(run)
        except ValueError:
            return None
        known = tuple(t for t in topics.split(",") if t.split(":")[0] in TOPICS)
        return cls(sender, run_id, known or TOPICS)


def send(conn: Connection, wakeups: Sequence[Wakeup]) -> None:
    """NOTIFY each wake-up, in one statement (commits on the caller's commit)."""
    if wakeups:
        conn.execute(queries.text("notify"), {"ch": CHANNEL, "ps": [w.payload() for w in wakeups]})


def listen_statement() -> str:
    """What a listening connection sends first (the API's notifier, on psycopg directly)."""
    return queries.sql("listen")


def alive_statement() -> str:
    """What a listening connection sends between waits: a dead connection raises on it."""
    return queries.sql("listen_alive")
