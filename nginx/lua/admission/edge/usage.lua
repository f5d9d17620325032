-- admission.edge.usage: see the response body pass (body_filter phase) without holding it back,
-- and find the token usage: the JSON `usage` of a plain response, or the final SSE usage chunk
-- of a stream. Only a bounded tail of the stream is kept, never the whole of it.
local cjson = require "cjson.safe"

local ngx = ngx
local str_find = string.find
local str_sub = string.sub
local tbl_concat = table.concat

local _M = { _VERSION = "0.1.0" }

local TAIL = 8192 -- bytes of a stream kept to find the usage chunk
local MAX_JSON = 1048576 -- a plain response up to this is parsed whole; larger, scanned
local WINDOW = 4096 -- bytes of a large plain response kept between chunks (usage is < 1 KiB)
local USAGE_MAX = 2048

-- The last complete `"usage":{...}` object in `buf` (its JSON text), or nil. Inside a JSON
-- string every quote is escaped, so a match not preceded by a backslash is a key; a usage
-- object holds only numbers and objects of numbers, so braces balance without strings.
local function scan_usage(buf)
  local found
  local pos = 1
  while true do
    local s, e = str_find(buf, '"usage"%s*:%s*{', pos)
    if not s then break end
    pos = e + 1
    if s == 1 or str_sub(buf, s - 1, s - 1) ~= "\\" then
      local depth, i = 0, e
      while i <= #buf and i - e < USAGE_MAX do
        local c = str_sub(buf, i, i)
        if c == "{" then
          depth = depth + 1
        elseif c == "}" then
          depth = depth - 1
          if depth == 0 then
            found = str_sub(buf, e, i)
            break
          end
        end
        i = i + 1
      end
    end
  end
  return found
end

function _M.body_filter()
  local ctx = ngx.ctx
  if not ctx.ticket then
    return
  end
  if ctx.lease_until and ngx.now() > ctx.lease_until then
    -- Past its lease (queue.lease_ttl_s): the node slot and KV it booked may be another's
    -- now. Cut the response off; vLLM aborts a request whose client went away.
    if not ctx.cut then
      ctx.cut = true
      ngx.log(ngx.WARN, "admission: response cut off at its lease's end (queue.lease_ttl_s)")
    end
    return ngx.ERROR
  end
  local chunk = ngx.arg[1]
  if not chunk or chunk == "" then
    return
  end
  if ctx.stream then
    -- Keep a bounded tail: at most TAIL bytes are copied per chunk, whatever the stream's size.
    local buf = (ctx.usage_buf or "") .. chunk
    if #buf > TAIL then buf = str_sub(buf, -TAIL) end
    ctx.usage_buf = buf
    return
  end
  -- A plain body: collect the parts and join them once, at the end (no copy per chunk).
  local size = (ctx.usage_size or 0) + #chunk
  ctx.usage_size = size
  if size <= MAX_JSON then
    local parts = ctx.usage_parts
    if not parts then
      parts = {}
      ctx.usage_parts = parts
    end
    parts[#parts + 1] = chunk
    return
  end
  -- Larger (n, top_logprobs, echo): keep nothing whole. Scan a sliding window for the
  -- top-level "usage" object as the body passes; the last one seen is the answer's.
  local win = ctx.usage_win
  if ctx.usage_parts then
    win = str_sub(tbl_concat(ctx.usage_parts), -WINDOW)
    ctx.usage_parts = nil
  end
  win = (win or "") .. chunk
  local found = scan_usage(win)
  if found then ctx.usage_found = found end
  if str_find(win, '"finish_reason"%s*:%s*"length"') then
    ctx.usage_cut = true -- an answer cut at its cap, somewhere in the body
  elseif not ctx.usage_cut and str_find(win, '"finish_reason"%s*:%s*"') then
    ctx.usage_ended = true
  end
  ctx.usage_win = str_sub(win, -WINDOW)
end

-- How the answer ended (the engine's finish_reason): "length" when any choice was cut at its
-- cap, else the last one found; nil when none is seen. A stream's is in its kept tail.
local function finish_of(ctx, doc)
  if ctx.usage_found then
    return ctx.usage_cut and "length" or (ctx.usage_ended and "stop" or nil)
  end
  if not ctx.stream then
    local choices = type(doc) == "table" and doc.choices
    if type(choices) ~= "table" then return nil end
    local last
    for _, c in ipairs(choices) do
      local f = type(c) == "table" and c.finish_reason
      if f == "length" then return "length" end
      if type(f) == "string" then last = f end
    end
    return last
  end
  local last
  for f in string.gmatch(ctx.usage_buf or "", '"finish_reason"%s*:%s*"([%w_]+)"') do
    if f == "length" then return "length" end
    last = f
  end
  return last
end

-- Returns {prompt_tokens, completion_tokens, prompt_tokens_details}, finish (or nil: unseen);
-- or nil.
function _M.extract(ctx)
  local buf = ctx.usage_buf
  if ctx.usage_found then -- a large plain body: its scanned usage
    buf = '{"usage":' .. ctx.usage_found .. "}"
  elseif not ctx.stream and ctx.usage_parts then
    buf = tbl_concat(ctx.usage_parts)
  end
  if not buf or buf == "" then
    return nil
  end
  local doc
  if ctx.stream and not ctx.usage_found then
    local last
    local pos = 1
    while true do
      local s, e = str_find(buf, "data: {[^\n]*\"usage\"[^\n]*", pos)
      if not s then break end
      last = str_sub(buf, s + 6, e)
      pos = e + 1
    end
    if not last then return nil end
    doc = cjson.decode(last)
  else
    doc = cjson.decode(buf)
  end
  local u = type(doc) == "table" and doc.usage
  if type(u) == "table" and u.completion_tokens == nil and ngx.var.uri == "/v1/embeddings" then
    u.completion_tokens = 0 -- an embedding generates nothing (OpenAI's usage has no count)
  end
  -- Both counts or nothing: a null or missing count makes the sidecar keep what was booked.
  if type(u) ~= "table" or type(u.prompt_tokens) ~= "number"
      or type(u.completion_tokens) ~= "number" then
    return nil
  end
  -- The engine's cached prompt tokens go on in the engine's own shape: the sidecar reads
  -- usage.prompt_tokens_details.cached_tokens (admission/usage.py), the charge at the
  -- tenant's cached_token_price and the status page's predicted-vs-found line with it.
  local details = u.prompt_tokens_details
  local cached = type(details) == "table" and type(details.cached_tokens) == "number"
    and details.cached_tokens or nil
  return { prompt_tokens = u.prompt_tokens, completion_tokens = u.completion_tokens,
           prompt_tokens_details = cached and { cached_tokens = cached } or nil },
         finish_of(ctx, doc)
end

return _M
