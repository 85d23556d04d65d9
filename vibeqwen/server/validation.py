"""HTTP 400 messages for request bodies that fail validation: one line naming each bad field (`messages[0].role:
Input should be ...`), the members of a union field the value came closest to, and the path they share as the
error's `param`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def describe_validation_errors(errors: Sequence[Any], rename: Callable[[str], str] | None = None,
                               ) -> tuple[str, str | None]:
    """(message, param) for pydantic's `ValidationError.errors()` (FastAPI's start their locations with "body"); param
    is the path all errors share, e.g. `messages[0].role`. rename: maps each param as written (`tools[0].function.name`)
    to the one the client should read (the Responses API names its own fields)."""
    rename = rename or (lambda param: param)
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return (
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')}",
            None,
        )
    # FastAPI puts "body" first; a key the client named "body" further in stays
    locs = [list(e.get("loc", ()))[1:] if list(e.get("loc", ()))[:1] == ["body"] else list(e.get("loc", ()))
            for e in errors]
    # a validator's ValueError reads "Value error, <its message>": the message is enough
    errors = [dict(e, msg=str(e.get("msg", "")).removeprefix("Value error, ")) for e in errors]
    if locs == [[]] and first.get("type") == "missing":
        return "the request body is missing", None
    if any(_union_tag_index(loc) is not None for loc in locs):
        errors, locs = _closest_union_members(errors, locs)
    shared = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(shared), len(loc)) and shared[n] == loc[n]:
            n += 1
        shared = shared[:n]
    message = "; ".join(
        f"{rename(_param(loc))}: {e.get('msg')}" if loc else str(e.get("msg"))
        for loc, e in zip(locs[:_MAX_REPORTED_ERRORS], errors[:_MAX_REPORTED_ERRORS])
    )
    if len(errors) > _MAX_REPORTED_ERRORS:
        message += f"; and {len(errors) - _MAX_REPORTED_ERRORS} more errors"
    shared_param = _param(shared)
    return message, rename(shared_param) if shared_param is not None else None


#: Where the request models have a field of several accepted types (a union): pydantic then reports one error per
#: member it tried, each under a member tag ("str", "list[constrained-int]", "NamedToolChoice", ...) at the position
#: after these paths (int: any list index).
_UNION_PATHS = (("prompt",), ("input",), ("stop",), ("guided_json",), ("tool_choice",), ("messages", int, "content"),
                ("response_format", "json_schema", "schema"), ("structured_outputs", "json"))

#: Error types saying the value is of another type than a member's (the member did not match at all), as opposed
#: to a member whose type matched and a constraint or a required field failed.
_MISMATCH_TYPES = ("literal_error", "model_type", "model_attributes_type", "is_instance_of", "union_tag_invalid")

#: At most this many errors in a 400's message (a list of 400,000 bad items would otherwise make a reply of tens of MB).
_MAX_REPORTED_ERRORS = 5


def _union_tag_index(loc: Sequence[Any]) -> int | None:
    """The position of the union member tag in `loc`, when `loc` is inside one of _UNION_PATHS, else None."""
    for path in _UNION_PATHS:
        n = len(path)
        if len(loc) > n and isinstance(loc[n], str) and all(
                isinstance(part, int) if want is int else part == want for part, want in zip(loc, path)):
            return n
    return None


def _closest_union_members(errors: Sequence[Any], locs: list[list[Any]]) -> tuple[list[Any], list[list[Any]]]:
    """For each union field, the errors of the member(s) the value came closest to, their member tags dropped from
    the locations; other errors as they are. Closest: the member whose errors reach deepest into the value (it
    matched the outer shape: a list whose item 1 is not a string), then with the fewest errors, then one whose type
    matched and a constraint failed (a token id below 0) over a type mismatch. Tied members' errors at one location
    read "a valid string or a valid list". `prompt: [-1]` gives "prompt[0]: Input should be greater than or equal to
    0", not one line per member."""
    members: dict[tuple, dict[str, list[int]]] = {}  # union field path -> member tag -> error indices
    for k, loc in enumerate(locs):
        t = _union_tag_index(loc)
        if t is not None:
            members.setdefault(tuple(loc[:t]), {}).setdefault(loc[t], []).append(k)
    drop: set[int] = set()
    for by_tag in members.values():
        def score(idx: list[int]) -> tuple[int, int, bool]:
            constraint = any(not (str(errors[k].get("type", "")).endswith(("_type", "_parsing"))
                                  or errors[k].get("type") in _MISMATCH_TYPES) for k in idx)
            return max(len(locs[k]) for k in idx), -len(idx), constraint

        best = max(score(idx) for idx in by_tag.values())
        drop |= {k for idx in by_tag.values() if score(idx) != best for k in idx}
    merged: dict[tuple, dict] = {}  # location (tags dropped) -> its error, tied members' messages joined
    prefix = "Input should be "
    for k, (e, loc) in enumerate(zip(errors, locs)):
        if k in drop:
            continue
        t = _union_tag_index(loc)
        key = tuple(loc[:t] + loc[t + 1:]) if t is not None else tuple(loc) + (("#", k),)
        msg = str(e.get("msg", ""))
        if key not in merged:
            merged[key] = dict(e, msg=msg)
        elif msg.removeprefix(prefix) not in merged[key]["msg"].removeprefix(prefix).split(" or "):
            merged[key]["msg"] += " or " + msg.removeprefix(prefix)
    out_locs = [[p for p in key if not (isinstance(p, tuple) and p and p[0] == "#")] for key in merged]
    return list(merged.values()), out_locs


def _param(loc: Sequence[Any]) -> str | None:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
