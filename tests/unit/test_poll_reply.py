"""A poll reply has one shape: `work` and `commands`, both always present, each empty when
there is none of it, the same in the data layer (`Poll`) and on the wire (`PollOut`)."""

from __future__ import annotations

import dataclasses

from api.service import dump
from staleflow_db.protocol import Command, Poll, Work
from workers.wire.models import PollOut


def test_the_data_layer_and_the_wire_share_one_poll_shape():
    assert [f.name for f in dataclasses.fields(Poll)] == list(PollOut.model_fields) == ["work", "commands"]
    assert [f.name for f in dataclasses.fields(Work)] == list(
        PollOut.model_fields["work"].annotation.__args__[0].model_fields
    )
    assert [f.name for f in dataclasses.fields(Command)] == list(
        PollOut.model_fields["commands"].annotation.__args__[0].model_fields
    )


def test_each_part_is_optional_and_always_serialised():
    assert PollOut.model_validate({}).model_dump() == {"work": [], "commands": []}
    assert dump(Poll, Poll()) == PollOut().model_dump_json().encode() == b'{"work":[],"commands":[]}'
    only_commands = Poll(commands=[Command(3, "pull", None, None, 2)])
    out = PollOut.model_validate_json(dump(Poll, only_commands))
    assert out.work == [] and [(c.kind, c.target_version) for c in out.commands] == [("pull", 2)]
    schema = PollOut.model_json_schema()
    assert "required" not in schema and set(schema["properties"]) == {"work", "commands"}
