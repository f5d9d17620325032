-- admission.edge.request: read the body once, validate what admission needs, estimate the
-- prompt size, and rewrite the body for vLLM (access phase).
-- The rewrite appends fields to the client's JSON text instead of re-encoding it, so arrays,
-- numbers and unknown fields reach vLLM byte for byte (a duplicate key resolves to ours).
local cjson = require "cjson.safe"

local ngx = ngx
local ngx_md5 = ngx.md5
local math_floor = math.floor
local math_min = math.min
local tbl_concat = table.concat
local math_max = math.max
local str_find = string.find
local str_match = string.match
local str_sub = string.sub
local type = type

local _M = { _VERSION = "0.1.0" }

local IMAGE_TOKENS = 765   -- an image part, as OpenAI counts a high-detail 512 px tile set
local AUDIO_TOKENS = 1500  -- an audio part: a 30 s window of Whisper-style encoders
local VIDEO_TOKENS = 8192  -- a video part: frames × image tokens, bounded by the model's length
-- Multimodal parts by type (vLLM's content part names); any other part counts its JSON text.
local PART_TOKENS = {
  image_url = IMAGE_TOKENS, image = IMAGE_TOKENS, image_pil = IMAGE_TOKENS,
  image_embeds = IMAGE_TOKENS, input_image = IMAGE_TOKENS,
  input_audio = AUDIO_TOKENS, audio_url = AUDIO_TOKENS, audio = AUDIO_TOKENS,
  video_url = VIDEO_TOKENS, video = VIDEO_TOKENS,
}
local MAX_COPIES = 128    -- n / best_of above this are refused (vLLM's own bound is similar)
local MAX_TOKENS = 10000000
-- The prompt head's fingerprint (admission.scheduling.prefixes): chained hashes of blocks of
-- this many characters of what the engine will see, at most PREFIX_MAX_BLOCKS of them.
-- 512 characters ≈ 128 tokens: the CPU engine's KV block, 8 of a GPU engine's.
local PREFIX_CHARS = 512
local PREFIX_MAX_BLOCKS = 64
_M.PREFIX_CHARS = PREFIX_CHARS

-- Characters and explicit tokens of a prompt or message content: a string, an array of
-- parts ({type=text,text=...} / {type=image_url,...}), or token ids.
local function size(v)
  if type(v) == "string" then
    return #v, 0
  end
  local chars, tokens = 0, 0
  if type(v) == "table" then
    for _, part in ipairs(v) do
      if type(part) == "table" then
        local media = PART_TOKENS[part.type]
        if type(part.text) == "string" then
          chars = chars + #part.text
        elseif media then
          tokens = tokens + media
        elseif part.image_url ~= nil then
          tokens = tokens + IMAGE_TOKENS
        else
          chars = chars + #(cjson.encode(part) or "") -- a part we do not know: its text
        end
      elseif type(part) == "string" then
        chars = chars + #part
      elseif type(part) == "number" then
        tokens = tokens + 1 -- a token id
      end
    end
  end
  return chars, tokens
end

local function text_len(v)
  return type(v) == "string" and #v or 0
end

-- The text of a message content for the fingerprint: strings and text parts as they are, other
-- parts by their JSON (an image's URL tells images apart).
local function content_text(v)
  if type(v) == "string" then
    return v
  end
  if type(v) ~= "table" then
    return ""
  end
  local out = {}
  for _, part in ipairs(v) do
    if type(part) == "table" and type(part.text) == "string" then
      out[#out + 1] = part.text
    else
      out[#out + 1] = cjson.encode(part) or ""
    end
  end
  return tbl_concat(out, "\n")
end

-- Chained hashes of the full PREFIX_CHARS blocks of `text` (16 hex digits each: the first
-- half of MD5 over the previous hash and the block), or nil when not one block is full.
local function fingerprint(text)
  local n = math_min(math_floor(#text / PREFIX_CHARS), PREFIX_MAX_BLOCKS)
  if n == 0 then
    return nil
  end
  local out, prev = {}, ""
  for i = 1, n do
    prev = str_sub(ngx_md5(prev .. str_sub(text, (i - 1) * PREFIX_CHARS + 1, i * PREFIX_CHARS)), 1, 16)
    out[i] = prev
  end
  return out
end

-- What a chat template renders, in order, as far as the fingerprint reaches: tools, then each
-- message's role, name, content and tool calls.
local function chat_head(body)
  local parts, len, limit = {}, 0, PREFIX_CHARS * PREFIX_MAX_BLOCKS
  if type(body.tools) == "table" then
    parts[1] = cjson.encode(body.tools) or ""
    len = #parts[1]
  end
  for _, m in ipairs(body.messages) do
    if len >= limit then break end
    local piece = tostring(m.role) .. "\n" .. (type(m.name) == "string" and m.name .. "\n" or "")
      .. content_text(m.content)
      .. (type(m.tool_calls) == "table" and (cjson.encode(m.tool_calls) or "") or "") .. "\n"
    parts[#parts + 1] = piece
    len = len + #piece
  end
  return str_sub(tbl_concat(parts), 1, limit)
end

-- A positive integer field, absent or null allowed (nil); false, message when invalid.
local function positive_int(body, key, max)
  local v = body[key]
  if v == nil or v == cjson.null then
    return nil
  end
  if type(v) ~= "number" or v < 1 or v ~= math_floor(v) or v > max then
    return false, key .. " must be an integer between 1 and " .. max
  end
  return v
end

-- How many prompts a /v1/completions body carries: a list of strings or of token-id lists is
-- a batch, each generating its own completion.
local function prompts(p)
  if type(p) ~= "table" or #p == 0 then
    return { p }
  end
  local first = p[1]
  if type(first) == "string" or type(first) == "table" then
    return p
  end
  return { p } -- one prompt of token ids
end

-- Returns features {model, max_tokens, charged_output, stream, prompt_tokens, prefix, raw, chat}
-- (prefix: the head's block hashes, or nil) or
-- nil, status, code, message. The output cap is what vLLM will use: max_completion_tokens
-- before max_tokens (as vLLM reads them), the policy's default when neither is set; the charge
-- multiplies it by n / best_of and by the number of prompts.
function _M.read(chat, chars_per_token, default_max_tokens)
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
  local mct, err1 = positive_int(body, "max_completion_tokens", MAX_TOKENS)
  local mt, err2 = positive_int(body, "max_tokens", MAX_TOKENS)
  local n, err3 = positive_int(body, "n", MAX_COPIES)
  local best_of, err4 = positive_int(body, "best_of", MAX_COPIES)
  local bad = (mct == false and err1) or (mt == false and err2) or (n == false and err3)
    or (best_of == false and err4)
  if bad then
    return nil, 400, "invalid_request", bad
  end
  local cap = mct or mt or default_max_tokens
  if body.stream ~= nil and type(body.stream) ~= "boolean" then
    return nil, 400, "invalid_request", "stream must be true or false"
  end
  local copies = math_max(n or 1, best_of or 1)
  local chars, tokens, count, prefix = 0, 0, 1, nil
  if chat then
    if type(body.messages) ~= "table" or #body.messages == 0 then
      return nil, 400, "invalid_request", "messages must be a non-empty array"
    end
    for _, m in ipairs(body.messages) do
      if type(m) ~= "table" then
        return nil, 400, "invalid_request", "each message must be an object"
      end
      -- Everything the chat template renders: content, name, the assistant's tool calls
      -- (arguments included), reasoning and refusal text, a tool message's id.
      local c, t = size(m.content)
      c = c + text_len(m.name) + text_len(m.reasoning_content) + text_len(m.reasoning)
        + text_len(m.refusal) + text_len(m.tool_call_id)
      if type(m.tool_calls) == "table" then
        c = c + #(cjson.encode(m.tool_calls) or "")
      end
      chars, tokens = chars + c + 16, tokens + t -- role and template overhead
    end
    for _, key in ipairs({ "tools", "functions", "documents" }) do -- templates render them
      if type(body[key]) == "table" then
        chars = chars + #(cjson.encode(body[key]) or "")
      end
    end
    prefix = fingerprint(chat_head(body))
  else
    local pr = body.prompt
    if type(pr) ~= "string" and (type(pr) ~= "table" or (#pr == 0 and next(pr) ~= nil)) then
      return nil, 400, "invalid_request",
        "prompt must be a string, an array of strings or an array of token ids"
    end
    local list = prompts(body.prompt)
    count = #list
    if type(body.prompt) == "string" then
      prefix = fingerprint(str_sub(body.prompt, 1, PREFIX_CHARS * PREFIX_MAX_BLOCKS))
    end
    for _, p in ipairs(list) do
      local c, t = size(p)
      chars, tokens = chars + c, tokens + t
    end
  end
  return {
    model = body.model,
    max_tokens = cap,
    charged_output = cap * copies * count,
    stream = body.stream == true,
    prompt_tokens = math_floor(chars / chars_per_token) + tokens + 1,
    prefix = prefix,
    raw = raw,
    chat = chat,
  }
end

-- Append vLLM's priority and the output cap that was charged (so the engine cannot generate
-- more than was paid for) and, for streams, ask for the usage chunk.
function _M.rewrite(features, priority)
  local raw = features.raw
  local last = str_match(raw, "^.*()}")
  local head = str_sub(raw, 1, last - 1)
  local empty = str_find(head, "^%s*{%s*$") ~= nil
  local cap = features.max_tokens
  local extra = '"priority":' .. priority .. ',"max_tokens":' .. cap
  if features.chat then
    extra = extra .. ',"max_completion_tokens":' .. cap
  end
  if features.stream then
    extra = extra .. ',"stream_options":{"include_usage":true}'
  end
  ngx.req.set_body_data(head .. (empty and "" or ",") .. extra .. "}")
end

return _M
