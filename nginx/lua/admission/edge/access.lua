-- admission.edge.access: the access phase of /v1/completions and /v1/chat/completions.
-- identify → read features → class check → ask the sidecar → rewrite the body → hand the
-- route to the relay (admission.edge.relay), whose balancer moves the bytes to the node.
-- Every refusal goes through admission.edge.respond.
local edge_table = require "admission.edge.table"
local identify = require "admission.edge.identify"
local request = require "admission.edge.request"
local admit = require "admission.edge.admit"
local respond = require "admission.edge.respond"
local relay = require "admission.edge.relay"

local ngx = ngx
local ngx_var = ngx.var
local log = ngx.log
local WARN = ngx.WARN

local _M = { _VERSION = "0.1.0" }

local function allowed(list, value)
  for _, v in ipairs(list or {}) do
    if v == value then return true end
  end
  return false
end

local fail_open_rr = 0

function _M.run()
  -- On the internal server (`server_name admission-internal`, listening on a unix socket for
  -- the batch workers: both are checked) the tenant is named by header; everywhere else by the
  -- API key.
  local trusted = ngx_var.server_name == "admission-internal"
    and string.sub(ngx_var.server_addr or "", 1, 5) == "unix:"
    and ngx_var.http_x_admission_batch_tenant
  identify.strip_internal_headers()
  local tid, tenant
  if trusted then
    tid, tenant = identify.by_id(trusted)
  else
    tid, tenant = identify.tenant()
  end
  if not tid then
    return respond.unidentified(tenant)
  end
  local t = edge_table.get()
  local uri = ngx_var.uri
  local kind = uri == "/v1/chat/completions" and "chat"
    or (uri == "/v1/embeddings" and "embeddings") or "completion"
  if kind == "embeddings" and not t.admit_embeddings then
    return respond.not_served() -- edge.admit_embeddings off: as every path the edge does not serve
  end
  local f, status, code, msg = request.read(kind, t.chars_per_token or 4, t.default_max_tokens or 256,
                                           tenant.salt)
  if not f then
    return respond.error(status, code, msg)
  end
  local class = ngx_var.http_x_request_class or tenant.default_class
  if not allowed(tenant.classes, class) then
    return respond.error(403, "class_not_allowed", "request class not allowed for this tenant")
  end
  if not allowed(tenant.models, f.model) then
    return respond.error(404, "model_not_found", "model does not exist or is not available")
  end
  local ctx = ngx.ctx
  ctx.stream = f.stream
  ctx.estimate = f.prompt_tokens -- beside the engine's count in the release (its ratio: a metric)
  -- Named in the release (relay.lua); a sidecar takes names of at most 256 characters.
  ctx.model = #f.model <= 256 and f.model or nil
  ctx.class = type(class) == "string" and #class <= 256 and class or nil
  -- A client that goes away while queued aborts the subrequest, which frees its queue slot.
  ngx.on_abort(function() ngx.exit(499) end)
  -- arrived_at: when NGINX got the request, so that a request re-asked at another sidecar
  -- (its first one died while it waited) keeps its deadline and its aging credit, and
  -- request_id: NGINX's own (128 random bits): a re-ask is the same request, charged once.
  local d, res, err = admit.ask({ tenant = tid, class = class, model = f.model,
                                  prompt_tokens = f.prompt_tokens, max_tokens = f.charged_output,
                                  stream = f.stream, arrived_at = ngx.req.start_time(),
                                  request_id = ngx_var.request_id, prefix = f.prefix,
                                  prefix_chars = f.prefix and request.PREFIX_CHARS or nil })
  if not d then
    if res then
      return respond.passthrough(res)
    end
    if t.sidecar_failure_mode == "open" then
      log(WARN, "admission sidecar unavailable (", err, "): fail-open, proxying unadmitted")
      -- Only nodes that serve the model and took new work when a sidecar last saw them.
      local peers = {}
      for node, n in pairs(t.nodes or {}) do
        if type(n) == "table" and n.serving ~= false and allowed(n.models, f.model) then
          peers[#peers + 1] = { node = node, url = n.url }
        end
      end
      if #peers == 0 then
        return respond.error(503, "admission_unavailable", "admission service unavailable", 1)
      end
      table.sort(peers, function(a, b) return a.node < b.node end)
      fail_open_rr = fail_open_rr + 1
      local first = (fail_open_rr % #peers) + 1
      ctx.peers = { peers[first] }
      for i, p in ipairs(peers) do if i ~= first then ctx.peers[#ctx.peers + 1] = p end end
      -- The class's engine priority in its cold band (a sidecar would send band 0 only for a
      -- head it knows the node holds): fail-open batch never ties with cold realtime.
      request.rewrite(f, (t.engine_priority or {})[class] or t.classes[class] or 0)
      return relay.route(ctx)
    end
    log(WARN, "admission sidecar unavailable (", err, "): fail-closed")
    return respond.error(503, "admission_unavailable", "admission service unavailable", 1)
  end
  ctx.ticket = d.ticket
  ctx.ratelimit = d.ratelimit -- x-ratelimit-* on the answer (respond.header_filter)
  -- The lease expires lease_ttl_s from now: the answer must be over by then (balancer.lua
  -- bounds the wait for the engine, usage.lua cuts a response still running).
  ctx.lease_until = ngx.now() + (t.lease_ttl_s or 600) - 1
  local peers = { { node = d.node, url = d.url } }
  for _, fb in ipairs(d.fallbacks or {}) do peers[#peers + 1] = fb end
  ctx.peers = peers
  request.rewrite(f, d.priority)
  relay.route(ctx)
end

-- /v1/files and /v1/batches: authenticate like every call, then hand the request to a sidecar
-- with the tenant named (the key itself goes no further).
-- The Batch API's paths, exactly (ids are [A-Za-z0-9_-]): anything else under /v1/files or
-- /v1/batches (dot segments, encoded slashes, other routes of the sidecar) is not passed on.
local BATCH_PATHS = {
  "^/v1/files$", "^/v1/files/[%w_%-]+$", "^/v1/files/[%w_%-]+/content$",
  "^/v1/batches$", "^/v1/batches/[%w_%-]+$", "^/v1/batches/[%w_%-]+/cancel$",
}

-- The request's path as sent, when NGINX's normalised one is the same (nothing encoded, no
-- dot segments): only such a path is matched against the policy's lists.
local function plain_path()
  local raw = string.match(ngx_var.request_uri or "", "^[^?]*")
  return raw == ngx_var.uri and raw or nil
end

local function batch_path()
  local raw = plain_path()
  if not raw then return false end -- encoded or unnormalised: not ours
  for _, pattern in ipairs(BATCH_PATHS) do
    if string.find(raw, pattern) then return true end
  end
  return false
end

function _M.forward_tenant()
  if not batch_path() then
    return respond.not_served()
  end
  identify.strip_internal_headers()
  local tid, tenant = identify.tenant()
  if not tid then
    return respond.unidentified(tenant)
  end
  ngx.req.set_header("X-Admission-Tenant", tid)
  ngx.req.clear_header("Authorization")
end

-- Any other /v1/ path: 404 (respond.not_served) unless edge.passthrough names it (or a path
-- it lies under, the longest first); then the key is checked as for every call, the tenant
-- named to the upstream and the key itself dropped, and NGINX proxies to the named URL. Not
-- admitted, limited or charged: for APIs the engines' ledger does not cover.
function _M.passthrough()
  local path = plain_path()
  local to, best = nil, 0
  for prefix, url in pairs(path and edge_table.get().passthrough or {}) do
    local n = #prefix
    if n > best and (path == prefix or string.sub(path, 1, n + 1) == prefix .. "/") then
      to, best = url, n
    end
  end
  if not to then
    return respond.not_served()
  end
  identify.strip_internal_headers()
  local tid, tenant = identify.tenant()
  if not tid then
    return respond.unidentified(tenant)
  end
  ngx.req.set_header("X-Admission-Tenant", tid)
  ngx.req.clear_header("Authorization")
  ngx_var.admission_passthrough = to
end

return _M
