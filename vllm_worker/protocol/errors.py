"""How a request's failure travels from a worker to the frontend: a structured value, never a string told
apart by its wording. `kind` says whose failure it is — `internal` (our own code: HTTP 500), `hook` (the
caller's hook raised or returned something invalid: 400), `limit` (an operator limit was reached: 400), `unsupported` (the served model lacks what was asked: 400) —
`stage` where it happened, `message` what the caller reads (with the hook's traceback, or the knob)."""

from __future__ import annotations

from typing import Literal, TypedDict

Kind = Literal["internal", "hook", "limit", "unsupported"]


class Failure(TypedDict):
    kind: Kind
    stage: str | None
    message: str


# The HTTP status of each kind: only the caller's failures are a 4xx.
STATUS: dict[str, int] = {"internal": 500, "hook": 400, "limit": 400, "unsupported": 400}


class CallerError(ValueError):
    """A failure that is the caller's (a `Failure` of a kind other than `internal`), raised where the
    frontend learns of it: told apart from our own bugs by this class, never by its wording. `param`: the
    field of the request it names."""

    def __init__(self, failure: Failure, param: str | None) -> None:
        if failure["kind"] == "internal":
            raise ValueError("an internal failure is ours, never the caller's")
        super().__init__(failure["message"])
        self.failure, self.param = failure, param

    @property
    def status(self) -> int:
        return STATUS[self.failure["kind"]]


def failure(kind: Kind, message: str, stage: str | None = None) -> Failure:
    return {"kind": kind, "stage": stage, "message": message}


def internal(stage: str, e: BaseException) -> Failure:
    """Our own code failed for a request at `stage`: it runs plain from then on, its results say why."""
    return failure(
        "internal",
        f"inspect-lens internal error while {stage}: {type(e).__name__}: {e} (this request "
        "ran without its capture/steering/hooks from then on; other requests were not affected)",
        stage,
    )


def all_internal(failures: dict[str, Failure]) -> bool:
    """Every failure is our own (a 500 / "inspect-lens request failed"), none the caller's."""
    return bool(failures) and all(f["kind"] == "internal" for f in failures.values())


def messages(failures: dict[str, Failure]) -> dict[str, str]:
    return {rid: f["message"] for rid, f in failures.items()}
