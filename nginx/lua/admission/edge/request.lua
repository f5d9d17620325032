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
local tbl_sort = table.sort
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

-- A value's JSON with object keys sorted, so that one value has one text whatever order the
-- client wrote its keys in (cjson's order follows the table's hash part, not the input).
local function canon(v)
  if type(v) ~= "table" then
    return cjson.encode(v) or ""
  end
  if #v > 0 or next(v) == nil then
    local out = {}
    for i, x in ipairs(v) do out[i] = canon(x) end
    return "[" .. tbl_concat(out, ",") .. "]"
  end
  local names = {}
  for k in pairs(v) do names[#names + 1] = tostring(k) end
  tbl_sort(names)
  local out = {}
  for i, k in ipairs(names) do
    out[i] = (cjson.encode(k) or '""') .. ":" .. canon(v[k])
  end
  return "{" .. tbl_concat(out, ",") .. "}"
end

-- Body fields that do not change what the engine renders as the prompt (sampling, output and
-- transport options, and what the edge writes itself). Every other field may (tools,
-- functions, documents, chat_template, chat_template_kwargs, add_generation_prompt,
-- tool_choice, fields this list does not know yet): it enters the fingerprint, so that two
-- requests the engine keys apart are never booked as one head. A field wrongly left in costs
-- a predicted hit; one wrongly left out would book N copies as one.
local NOT_RENDERED = {
  model = true, messages = true, prompt = true, max_tokens = true,
  max_completion_tokens = true, temperature = true, top_p = true, top_k = true, min_p = true,
  n = true, best_of = true, stream = true, stream_options = true, stop = true,
  stop_token_ids = true, seed = true, presence_penalty = true, frequency_penalty = true,
  repetition_penalty = true, logprobs = true, top_logprobs = true, logit_bias = true,
  user = true, priority = true, cache_salt = true, ignore_eos = true, min_tokens = true,
  skip_special_tokens = true, spaces_between_special_tokens = true, request_id = true,
  metadata = true, store = true, response_format = true, length_penalty = true,
  include_stop_str_in_output = true, service_tier = true, parallel_tool_calls = true,
  structured_outputs = true, guided_json = true, guided_regex = true, guided_choice = true,
  guided_grammar = true,
}

-- The body's rendered fields besides its messages or prompt, as one canonical text ("" when
-- there are none: a plain chat's fingerprint is its messages alone).
local function context(body)
  local names
  for k in pairs(body) do
    if not NOT_RENDERED[k] then
      names = names or {} -- a plain chat allocates nothing here
      names[#names + 1] = tostring(k)
    end
  end
  if not names then
    return ""
  end
  tbl_sort(names)
  local out = {}
  for i, k in ipairs(names) do out[i] = k .. "=" .. canon(body[k]) end
  return tbl_concat(out, "\n") .. "\n"
end

-- A message's fields beyond role, name, content and tool calls (a tool message's
-- tool_call_id, reasoning, refusal, fields this edge does not know), canonical; "" if none.
local MESSAGE_COMMON = { role = true, name = true, content = true, tool_calls = true }
local function message_rest(m)
  local rest
  for k, v in pairs(m) do
    if not MESSAGE_COMMON[k] then
      rest = rest or {} -- a plain message allocates nothing here
      rest[k] = v
    end
  end
  return rest and canon(rest) or ""
end

-- The text of a message content for the fingerprint: a string, and a part that holds only
-- {type = "text", text = ...}, as they are; any other part (an image, a part with an extra
-- key) by its canonical JSON (an image's URL tells images apart).
local function content_text(v)
  if type(v) == "string" then
    return v
  end
  if type(v) ~= "table" then
    return ""
  end
  local out = {}
  for _, part in ipairs(v) do
    local plain = type(part) == "table" and type(part.text) == "string"
      and (part.type == nil or part.type == "text")
    if plain then
      for k in pairs(part) do
        if k ~= "text" and k ~= "type" then plain = false break end
      end
    end
    out[#out + 1] = plain and part.text or canon(part)
  end
  return tbl_concat(out, "\n")
end

-- Chained hashes of the full PREFIX_CHARS blocks of `text` (16 hex digits each: the first
-- half of MD5 over the previous hash and the block), or nil when not one block is full. The
-- chain starts from the tenant's cache salt (its cache group's): the same head sent by two
-- tenants that share no group has two fingerprints, as it has two keys in the engine's cache.
local function fingerprint(text, salt)
  local n = math_min(math_floor(#text / PREFIX_CHARS), PREFIX_MAX_BLOCKS)
  if n == 0 then
    return nil
  end
  local out, prev = {}, salt
  for i = 1, n do
    prev = str_sub(ngx_md5(prev .. str_sub(text, (i - 1) * PREFIX_CHARS + 1, i * PREFIX_CHARS)), 1, 16)
    out[i] = prev
  end
  return out
end

-- What the engine renders, in order, as far as the fingerprint reaches: the body's other
-- rendered fields (tools among them), then each message's role, name, content, tool calls and
-- any other field it has.
local function chat_head(body)
  local parts, limit = { context(body) }, PREFIX_CHARS * PREFIX_MAX_BLOCKS
  local len = #parts[1]
  for _, m in ipairs(body.messages) do
    if len >= limit then break end
    local piece = tostring(m.role) .. "\n" .. (type(m.name) == "string" and m.name .. "\n" or "")
      .. content_text(m.content)
      .. (type(m.tool_calls) == "table" and canon(m.tool_calls) or "") .. message_rest(m) .. "\n"
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

-- /v1/embeddings: the input (a string, strings, token ids or lists of them) is the whole
-- charge; the engine generates nothing, so one output token is booked (a lease needs a cap of
-- at least 1) and the release settles the charge to the engine's prompt count.
local function embeddings(body, raw, chars_per_token, salt)
  local input = body.input
  if type(input) ~= "string" and (type(input) ~= "table" or #input == 0) then
    return nil, 400, "invalid_request",
      "input must be a string, an array of strings or an array of token ids"
  end
  local chars, tokens = 0, 0
  for _, p in ipairs(prompts(input)) do
    local c, t = size(p)
    chars, tokens = chars + c, tokens + t
  end
  return {
    model = body.model, max_tokens = 1, charged_output = 1, stream = false,
    prompt_tokens = math_floor(chars / chars_per_token) + tokens + 1,
    raw = raw, embeddings = true, salt = salt,
  }
end

-- Returns features {model, max_tokens, charged_output, stream, prompt_tokens, prefix, raw, chat,
-- salt} (prefix: the head's block hashes, or nil; salt: the tenant's cache salt, nil while the
-- edge table has none: the request is then booked uncached, alone in the engine's cache) or
-- nil, status, code, message. The output cap is what vLLM will use: max_completion_tokens
-- before max_tokens (as vLLM reads them), the policy's default when neither is set; the charge
-- multiplies it by n / best_of and by the number of prompts.
function _M.read(kind, chars_per_token, default_max_tokens, salt)
  local chat = kind == "chat"
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
  if kind == "embeddings" then
    return embeddings(body, raw, chars_per_token, salt)
  end
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
    prefix = salt and fingerprint(chat_head(body), salt) or nil
  else
    local pr = body.prompt
    if type(pr) ~= "string" and (type(pr) ~= "table" or (#pr == 0 and next(pr) ~= nil)) then
      return nil, 400, "invalid_request",
        "prompt must be a string, an array of strings or an array of token ids"
    end
    local list = prompts(body.prompt)
    count = #list
    if type(body.prompt) == "string" and salt then
      local head = context(body) .. body.prompt
      prefix = fingerprint(str_sub(head, 1, PREFIX_CHARS * PREFIX_MAX_BLOCKS), salt)
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
    salt = salt,
  }
end

-- Append vLLM's priority, the output cap that was charged (so the engine cannot generate
-- more than was paid for) and the tenant's cache salt (a client's own `cache_salt` is
-- overridden: a duplicate key resolves to the last), and, for streams, ask for the usage chunk.
-- Without a salt in the edge table (its secret not read from Redis yet) the request gets one of
-- its own: computed alone, never a hit on another tenant's head.
function _M.rewrite(features, priority)
  local raw = features.raw
  local last = str_match(raw, "^.*()}")
  local head = str_sub(raw, 1, last - 1)
  local empty = str_find(head, "^%s*{%s*$") ~= nil
  local cap = features.max_tokens
  local salt = features.salt or ("r" .. ngx.var.request_id)
  local extra = '"priority":' .. priority .. ',"cache_salt":"' .. salt .. '"'
  if not features.embeddings then
    extra = extra .. ',"max_tokens":' .. cap
  end
  if features.chat then
    extra = extra .. ',"max_completion_tokens":' .. cap
  end
  if features.stream then
    extra = extra .. ',"stream_options":{"include_usage":true}'
  end
  ngx.req.set_body_data(head .. (empty and "" or ",") .. extra .. "}")
end

return _M
