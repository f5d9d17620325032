-- admission.edge.request: read the body once, validate what admission needs, estimate the
-- prompt size, and rewrite the body for vLLM (access phase).
-- The rewrite appends fields to the client's JSON text instead of re-encoding it, so arrays,
-- numbers and unknown fields reach vLLM byte for byte (a duplicate key resolves to ours).
local cjson = require "cjson.safe"

local ngx = ngx
local math_floor = math.floor
local str_find = string.find
local str_match = string.match
local str_sub = string.sub
local type = type

local _M = { _VERSION = "0.1.0" }

local function text_len(v)
  if type(v) == "string" then
    return #v
  end
  local n = 0
  if type(v) == "table" then
    for _, part in ipairs(v) do
      if type(part) == "table" and type(part.text) == "string" then
        n = n + #part.text
      elseif type(part) == "string" then
        n = n + #part
      elseif type(part) == "number" then
        n = n + 4 -- a token id
      end
    end
  end
  return n
end

-- Returns features {model, max_tokens, stream, prompt_tokens, raw} or nil, status, code, message.
function _M.read(chat, chars_per_token)
  ngx.req.read_body()
  local raw = ngx.req.get_body_data()
  if not raw then
    if ngx.req.get_body_file() then
      return nil, 413, "body_too_large", "request body too large"
    end
    return nil, 400, "invalid_json", "request body is empty"
  end
  local body = cjson.decode(raw)
  if type(body) ~= "table" or not str_find(raw, "^%s*{") then
    return nil, 400, "invalid_json", "request body must be a JSON object"
  end
  if type(body.model) ~= "string" or body.model == "" then
    return nil, 400, "invalid_model", "model must be a non-empty string"
  end
  local mt = body.max_tokens
  if mt == nil then mt = body.max_completion_tokens end
  if mt ~= nil and mt ~= cjson.null then
    if type(mt) ~= "number" or mt < 1 or mt ~= math_floor(mt) or mt > 10000000 then
      return nil, 400, "invalid_request", "max_tokens must be a positive integer"
    end
  else
    mt = nil
  end
  if body.stream ~= nil and type(body.stream) ~= "boolean" then
    return nil, 400, "invalid_request", "stream must be true or false"
  end
  local chars = 0
  if chat then
    if type(body.messages) ~= "table" or #body.messages == 0 then
      return nil, 400, "invalid_request", "messages must be a non-empty array"
    end
    for _, m in ipairs(body.messages) do
      if type(m) ~= "table" then
        return nil, 400, "invalid_request", "each message must be an object"
      end
      chars = chars + text_len(m.content) + 16 -- role and template overhead
    end
  else
    if body.prompt == nil then
      return nil, 400, "invalid_request", "prompt is required"
    end
    chars = text_len(body.prompt)
  end
  return {
    model = body.model,
    max_tokens = mt,
    stream = body.stream == true,
    prompt_tokens = math_floor(chars / chars_per_token) + 1,
    raw = raw,
  }
end

-- Append vLLM's priority and, for streams, ask for the usage chunk.
function _M.rewrite(features, priority)
  local raw = features.raw
  local last = str_match(raw, "^.*()}")
  local head = str_sub(raw, 1, last - 1)
  local empty = str_find(head, "^%s*{%s*$") ~= nil
  local extra = '"priority":' .. priority
  if features.stream then
    extra = extra .. ',"stream_options":{"include_usage":true}'
  end
  ngx.req.set_body_data(head .. (empty and "" or ",") .. extra .. "}")
end

return _M
