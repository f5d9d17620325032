-- admission.edge.failures: a sidecar socket that refuses connections is left alone for a
-- while, and said once per interval. A dead sidecar under load was tried by every request
-- (admit.lua, up to ~17 times each while it retried) and every release batch (release.lua),
-- and NGINX wrote a `connect() … failed` line for each try. Now a socket whose connect failed
-- (refused: nobody listens) is skipped for a backoff (0.5 s, doubling to 5 s) while another sidecar is tried, so NGINX's
-- own lines come a few per interval however many requests pass; this module's line says the
-- count and what to check: the first failure at once (the outage's start), then one line per
-- interval while it lasts, and one when the socket answers again. Per worker.
local ngx = ngx
local log = ngx.log
local ERR = ngx.ERR
local WARN = ngx.WARN
local now = ngx.now
local math_min = math.min

local _M = { _VERSION = "0.1.0" }

local INTERVAL_S = 10
local BACKOFF_S, MAX_BACKOFF_S = 0.5, 5
-- socket → { n = failures not logged yet, total, logged_at, down_until, backoff }
local seen = {}

-- Whether `socket` may be tried now (it is not in a backoff after a failed connect).
function _M.usable(socket)
  local s = seen[socket]
  return not s or now() >= s.down_until
end

function _M.connect_failed(what, socket, err)
  local t = now()
  local s = seen[socket]
  if not s then
    s = { n = 0, total = 0, logged_at = 0, down_until = 0, backoff = 0 }
    seen[socket] = s
  end
  s.n, s.total = s.n + 1, s.total + 1
  -- Only a socket nobody listens on is skipped: a full accept queue under a burst (EAGAIN, a
  -- timeout) is a live sidecar, to be tried again at once.
  local e = tostring(err)
  if string.find(e, "refused", 1, true) or string.find(e, "No such file", 1, true) then
    s.backoff = math_min(MAX_BACKOFF_S, s.backoff > 0 and s.backoff * 2 or BACKOFF_S)
    s.down_until = t + s.backoff
  end
  if t - s.logged_at >= INTERVAL_S then
    log(ERR, "admission: ", s.n, " connect(s) to ", what, " ", socket, " failed",
        s.total > s.n and (" in the last " .. INTERVAL_S .. " s") or "",
        " (", tostring(err), "); is that sidecar running? Skipped for up to ",
        MAX_BACKOFF_S, " s at a time meanwhile")
    s.n, s.logged_at = 0, t
  end
end

function _M.connected(what, socket)
  local s = seen[socket]
  if s then
    seen[socket] = nil
    log(WARN, "admission: ", what, " ", socket, " answers again after ", s.total,
        " failed connect(s)")
  end
end

return _M
