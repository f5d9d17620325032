"""`admission nginx-snippets` and `admission systemd-units`: the edge's NGINX files and the
processes' units, filled in for one production layout (one socket directory, one policy path).

The shipped files (admission/nginx/) carry `@@…@@` placeholders; this renders them for N
sidecars whose sockets live in one directory (the systemd units' /run/admission), plus what a
stock Debian NGINX needs besides: the `load_module` lines in the order the modules need them,
the batch workers' internal server, and the Lua modules themselves (copied next to the files,
so that NGINX's workers read them whatever the permissions of the Python installation). The
local stack (`admission up`) fills the same placeholders with `fill`.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

from admission.policy import Policy

NGINX_DIR = Path(str(resources.files("admission") / "nginx"))
# Debian's libnginx-mod-http-lua needs the NDK's module loaded first (else: undefined symbol
# ndk_set_var_value).
MODULES = (
    "/usr/lib/nginx/modules/ndk_http_module.so",
    "/usr/lib/nginx/modules/ngx_http_lua_module.so",
)
FILES = ("admission_http.conf", "admission_locations.conf")
UNITS_DIR = Path(str(resources.files("admission") / "systemd"))
# The one policy path of a production install: docs, units, snippets and the commands' default.
POLICY_PATH = "/etc/admission/policies.yaml"
SOCKET_DIR = "/run/admission"
ADMIN_PORT = 9100  # sidecar N's admin port is ADMIN_PORT + N (loopback), as in the units


def placeholders(
    policy: Policy, lua_dir: Path, socket_dir: Path, sidecars: int, edge_table: Path | None = None
) -> dict[str, str]:
    """Every placeholder of admission_http.conf and admission_locations.conf."""
    http = [socket_dir / f"sidecar-{i}.sock" for i in range(sidecars)]
    admit = [socket_dir / f"admit-{i}.sock" for i in range(sidecars)]
    return {
        "@@LUA_DIR@@": str(lua_dir),
        "@@EDGE_TABLE@@": str(edge_table or socket_dir / "edge.json"),
        "@@SIDECAR_SOCKET_LIST@@": ", ".join(f'"{s}"' for s in http),
        "@@ADMIT_SOCKET_LIST@@": ", ".join(f'"{s}"' for s in admit),
        "@@SIDECAR_SERVERS@@": "\n".join(f"    server unix:{s} max_fails=0;" for s in http),
        "@@RELAY_SOCKET@@": str(socket_dir / "edge-relay.sock"),
        "@@MAX_BODY@@": str(policy.edge.max_body_bytes),
        "@@MAX_FILE_BODY@@": str(policy.batch.max_file_bytes + 65536),  # + multipart headers
    }


def fill(text: str, subs: dict[str, str]) -> str:
    for k, v in subs.items():
        text = text.replace(k, v)
    return text


def render(policy: Policy, out: Path, sidecars: int, socket_dir: Path) -> list[Path]:
    """Write the filled-in files and the Lua modules into `out`; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    lua = out / "lua"
    shutil.rmtree(lua, ignore_errors=True)
    shutil.copytree(NGINX_DIR / "lua", lua)
    subs = placeholders(policy, lua, socket_dir, sidecars)
    written = []
    for name in FILES:
        path = out / name
        path.write_text(fill((NGINX_DIR / name).read_text(), subs))
        written.append(path)
    modules = out / "admission_modules.conf"
    modules.write_text(
        "# Top level of nginx.conf (before events { }), in this order.\n"
        + "".join(f"load_module {m};\n" for m in MODULES)
    )
    internal = out / "admission_internal.conf"
    internal.write_text(
        "# Inside http { }: the batch workers' way in (the tenant named by a header, not a key).\n"
        "# Its socket's directory must be reachable by the workers' group only.\n"
        "server {\n"
        f"    listen unix:{socket_dir / 'edge-internal.sock'};\n"
        "    server_name admission-internal;\n"
        f"    include {out / 'admission_locations.conf'};\n"
        "}\n"
    )
    return [*written, modules, internal, lua]


def note(out: Path, socket_dir: Path, group: str, run: list[str]) -> str:
    """What the operator must do besides including the files (printed by the command)."""
    procs = "\n".join(f"  {c}" for c in run)
    return f"""Run (as the units in {out / "systemd"} do; `systemctl enable --now
admission-sidecar@0 admission-sidecar@1 admission-agent` once they are in /etc/systemd/system):
{procs}
Two sidecars: the edge asks the other while one restarts or dies; with one, every request is
refused 503 admission_unavailable until it is back.
Include, in nginx.conf:
  top level, before events {{ }}:   include {out / "admission_modules.conf"};
      (not on Debian with libnginx-mod-http-lua: its modules-enabled/ loads them already,
       and loading them twice fails `nginx -t`: "module ... is already loaded")
  inside http {{ }}:                include {out / "admission_http.conf"};
                                   include {out / "admission_internal.conf"};   # Batch API
  inside the server {{ }} for /v1/:  include {out / "admission_locations.conf"};
NGINX's workers must be in group {group!r} (`user www-data;` with --group www-data), the group
the sidecars give their sockets (serve --socket-group {group}); {socket_dir} must be 0750 with
that group (the systemd units' RuntimeDirectoryMode does it).
Already have lua_package_path? Put {out / "lua"}/?.lua; first in yours and drop ours.
Already have init_worker_by_lua*? Move ours (admission_http.conf) into yours: NGINX takes one.
Already have location = /healthz? Keep one of them (ours answers the sidecars' status).
Uploads over client_body_buffer_size go to client_body_temp_path: it must be writable by the
workers (Debian: /var/lib/nginx/body). The shipped nginx.conf.template sets `access_log off`:
a log format of your own must never include $http_authorization.
"""


def units(
    exe: str, policy: Path, socket_dir: Path, group: str, token: Path | None = None
) -> dict[str, str]:
    """The shipped systemd units filled in: unit name → text. A socket directory under /run is
    the sidecars' RuntimeDirectory (systemd creates it, 0750); elsewhere it must exist."""
    if socket_dir.parent == Path("/run"):
        runtime = (
            f"RuntimeDirectory={socket_dir.name}\nRuntimeDirectoryPreserve=yes\n"
            "RuntimeDirectoryMode=0750\n"
        )
    else:
        runtime = f"# {socket_dir} must exist: install -d -m 0750 -g {group} {socket_dir}\n"
    subs = {
        "@@ADMISSION@@": exe,
        "@@POLICY@@": str(policy),
        "@@SOCKET_DIR@@": str(socket_dir),
        "@@GROUP@@": group,
        "@@RUNTIME_DIRECTORY@@": runtime,
        "@@ADMIN_TOKEN@@": f" --admin-token-file {token}" if token else "",
    }
    return {
        unit.name: fill(unit.read_text(), subs)
        for unit in sorted(UNITS_DIR.iterdir())
        if unit.name.endswith(".service")
    }


def commands(
    exe: str, policy: Path, socket_dir: Path, group: str, sidecars: int, token: Path | None = None
) -> list[str]:
    """The processes the rendered NGINX files expect, as shell commands (what the units run)."""
    serve = [
        f"{exe} serve --policy {policy} --unix {socket_dir}/sidecar-{i}.sock "
        f"--admit-unix {socket_dir}/admit-{i}.sock --socket-group {group} "
        f"--edge-table {socket_dir}/edge.json --port {ADMIN_PORT + i}"
        + (f" --admin-token-file {token}" if token else "")
        for i in range(sidecars)
    ]
    return [*serve, f"{exe} agent --policy {policy}"]
