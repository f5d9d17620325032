-- admission.edge.table: the tenant table the sidecar writes from policies.yaml (edge.json),
-- kept in sync per worker without restarting NGINX. init_worker phase starts a 1 s timer that
-- re-reads the file and swaps the decoded table when its content changed.
local cjson = require "cjson.safe"

local ngx = ngx
local io_open = io.open
local log = ngx.log
local ERR, NOTICE = ngx.ERR, ngx.NOTICE

local _M = { _VERSION = "0.1.0" }

local current = nil
local raw_current = nil
local path = nil

local function load()
  local f, why = io_open(path, "rb")
  if not f then
    -- io.open's reason names the path and the OS error ("…: Permission denied"): NGINX's
    -- workers must be in the sidecars' socket group to read it.
    return nil, "cannot open the edge table: " .. tostring(why)
  end
  local raw = f:read("*a")
  f:close()
  if raw == raw_current then
    return true
  end
  local t, err = cjson.decode(raw)
  if not t or type(t.keys) ~= "table" then
    return nil, "invalid edge table: " .. tostring(err)
  end
  current, raw_current = t, raw
  log(NOTICE, "admission edge table loaded")
  return true
end

function _M.init_worker(table_path)
  path = table_path
  local ok, err = load()
  if not ok then
    log(ERR, err)
  end
  ngx.timer.every(1, function(premature)
    if premature then return end
    local ok2, err2 = load()
    if not ok2 then
      log(ERR, err2)
    end
  end)
end

function _M.get()
  return current
end

return _M
