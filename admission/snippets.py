"""`admission nginx-snippets`: the edge's NGINX files, filled in for a production layout.

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


def note(out: Path, socket_dir: Path, group: str) -> str:
    """What the operator must do besides including the files (printed by the command)."""
    return f"""Include, in nginx.conf:
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
