-- admission.edge.identify: API key → tenant, at the edge (access phase).
-- Strips client-sent internal headers, hashes the bearer key with SHA-256 (libcrypto via FFI,
-- already loaded by nginx) and looks the digest up in the edge table. The key itself is never
-- logged; digests of recent keys are cached per worker so the hot path hashes once per key.
local ffi = require "ffi"
local lrucache = require "resty.lrucache"
local edge_table = require "admission.edge.table"

local ngx = ngx
local ngx_var = ngx.var
local clear_header = ngx.req.clear_header
local get_headers = ngx.req.get_headers
local str_byte = string.byte
local str_format = string.format
local str_lower = string.lower
local str_sub = string.sub
local tbl_concat = table.concat

ffi.cdef [[ unsigned char *SHA256(const unsigned char *d, size_t n, unsigned char *md); ]]
local C = ffi.C
local digest_buf = ffi.new("unsigned char[32]")

local _M = { _VERSION = "0.1.0" }

local cache = assert(lrucache.new(4096))

local function sha256_hex(s)
  C.SHA256(s, #s, digest_buf)
  local out = {}
  for i = 0, 31 do
    out[i + 1] = str_format("%02x", digest_buf[i])
  end
  return tbl_concat(out)
end

-- Drop every header a client could use to impersonate the edge's own decisions: all of them
-- (0 = no cap; NGINX's large_client_header_buffers already bounds the count). With a cap, an
-- internal header sent after the 100th reached the engines.
function _M.strip_internal_headers()
  for name, _ in pairs(get_headers(0)) do
    local n = str_lower(name)
    if str_sub(n, 1, 8) == "x-tenant" or str_sub(n, 1, 11) == "x-admission" then
      clear_header(name)
    end
  end
end

-- Returns tenant_id, tenant_entry or nil, reason.
function _M.tenant()
  local t = edge_table.get()
  if not t then
    return nil, "edge_table_missing"
  end
  local auth = ngx_var.http_authorization
  if not auth or str_lower(str_sub(auth, 1, 7)) ~= "bearer " then
    return nil, "missing_api_key"
  end
  local key = str_sub(auth, 8)
  if #key == 0 or #key > 512 then
    return nil, "invalid_api_key"
  end
  local digest = cache:get(key)
  if not digest then
    digest = sha256_hex(key)
    cache:set(key, digest)
  end
  local tid = t.keys[digest]
  if not tid then
    return nil, "invalid_api_key"
  end
  return tid, t.tenants[tid]
end

-- The tenant named by id (the batch worker, on the edge's internal socket): tenant_id, entry
-- or nil, reason.
function _M.by_id(tid)
  local t = edge_table.get()
  if not t then
    return nil, "edge_table_missing"
  end
  local entry = t.tenants[tid]
  if not entry then
    return nil, "invalid_api_key"
  end
  return tid, entry
end

_M._sha256_hex = sha256_hex
local _ = str_byte
return _M
