"""How a command's failure reaches the user: one sentence that says what to do, exit status 2,
never a traceback — for every mistake a user can fix (a missing file or directory, an invalid
policy, an unreachable sidecar, a missing or wrong token). The one place where errors of the
commands become sentences (httpx translates its transports' errors at one boundary the same way).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error

from admission.errors import PolicyError

POLICY_HINT = "pass the policy with --policy FILE (`admission example-policy` prints one)"


class CommandError(Exception):
    """A mistake in how a command was called, said in one sentence."""


def run(args: argparse.Namespace) -> int:
    """`args.fn(args)`, its fixable failures said as sentences on stderr (status 2)."""
    say = f"admission {args.cmd}: "
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        return 130
    except PolicyError as exc:
        for problem in exc.problems[:-1]:
            print(f"{say}{problem}", file=sys.stderr)
        print(f"{say}{exc.problems[-1]} — {POLICY_HINT}", file=sys.stderr)
    except urllib.error.HTTPError as exc:
        with exc:
            print(f"{say}{refused(exc)}", file=sys.stderr)
    except urllib.error.URLError as exc:
        where = getattr(args, "sidecar", "the sidecar")
        print(
            f"{say}cannot reach {where} ({exc.reason}) — is `admission serve --port` running "
            "there? Pass its admin URL with --sidecar",
            file=sys.stderr,
        )
    except CommandError as exc:
        print(f"{say}{exc}", file=sys.stderr)
    except OSError as exc:
        what = f"{exc.filename}: " if exc.filename else ""
        print(
            f"{say}{what}{exc.strerror or exc} — create it (or fix its permissions), or pass "
            "another path",
            file=sys.stderr,
        )
    return 2


def refused(exc: urllib.error.HTTPError) -> str:
    """What a sidecar's refusal means for the operator, from its OpenAI-shaped error body."""
    try:
        err = json.loads(exc.read() or b"{}").get("error", {})
    except ValueError:
        err = {}
    code, message = err.get("code", ""), err.get("message", exc.reason)
    if exc.code == 401:
        return (
            f"the sidecar refused: {message} — pass the admin token with --token-file FILE or "
            "$ADMISSION_ADMIN_TOKEN (the file `serve --admin-token-file` reads)"
        )
    if code == "admin_token_not_configured":
        return f"{message} — start the sidecar with --admin-token-file FILE"
    return f"the sidecar answered {exc.code} {code}: {message}"
