-- Tandem's HTTP edge: the first HTTP filter of every Envoy listener Tandem renders.
--
-- deploy/envoy_config.py inlines this file into the bootstrap after a prelude of locals it
-- computes: MAX_URL_BYTES, MAX_HEADER_BYTES, MAX_HEADER_COUNT and MAX_MESSAGE_BYTES (the
-- limits below), and
-- JSON_BODY_PATHS (path -> true for every POST rule of tandem.v1.Generation with a body,
-- read from the descriptor set).
--
-- Requests:
--   * a URL over MAX_URL_BYTES is a 414, request headers over MAX_HEADER_BYTES or
--     MAX_HEADER_COUNT fields a 431 (INVALID_ARGUMENT for a gRPC client; the codec's own
--     limits are far above, so that it is this answer that names the limit, not a reset
--     stream or a closed connection): the gRPC servers behind take 8 KiB of metadata,
--     and a bigger request would come back from them as RESOURCE_EXHAUSTED, a 429 that tells
--     the client to retry what can never pass;
--   * the API key's scheme is case-insensitive ("bearer KEY" is "Bearer KEY"); an
--     Authorization header of any other form is dropped, so that its value can never pass
--     for a key (api_key_auth, next in the chain, reads "Bearer KEY" or the bare value);
--   * gRPC is application/grpc or application/grpc+FORMAT; gRPC-Web (application/grpc-web...)
--     is not served: a 415 saying so, as for any other content type on a gRPC path;
--   * a request that is not gRPC is HTTP: marked, so that its errors leave in OpenAI's shape;
--   * a JSON body must be JSON (application/json, +json, or no content type), else a 415;
--   * a list in a query as the openai SDK writes it (include[]=a&include[]=b, brackets
--     percent-encoded or not) becomes the repeated parameter the transcoder reads
--     (include=a&include=b);
--   * GET /v1/responses/{id}?stream=true (a background response's events again) moves to the
--     /v1/responses/{id}:stream path, the GetResponseEvents RPC.
-- Whether a POST body asks to stream is read by Envoy's json_to_metadata filter (a JSON
-- parser, after the API key check) and acted on by stream_route.lua.
--
-- Responses to HTTP requests: no gRPC headers; event streams labelled text/event-stream;
-- every error (a gRPC status the transcoder turned into an HTTP status, the transcoder's own
-- 400 for bad JSON, Envoy's 503 when the upstream is down, the API key's 401, /health's 503)
-- leaves with OpenAI's body, {"error": {"message", "type", "param", "code"}}, its message
-- clipped to MAX_MESSAGE_BYTES.
--
-- Handles (headers, metadata) taken before a call that yields, such as body(), are invalid
-- after it: take them again.

local NAMESPACE = "tandem.openai"
local PROBE_PATHS = {["/health"] = true, ["/ping"] = true}
local GRPC_CODES = {
  [1] = "cancelled", [2] = "unknown", [3] = "invalid_argument", [4] = "deadline_exceeded",
  [5] = "not_found", [6] = "already_exists", [7] = "permission_denied",
  [8] = "resource_exhausted", [9] = "failed_precondition", [10] = "aborted",
  [11] = "out_of_range", [12] = "unimplemented", [13] = "internal", [14] = "unavailable",
  [15] = "data_loss", [16] = "unauthenticated",
}
local INVALID_ARGUMENT = 3
local API_KEY_HELP = "Incorrect or missing API key: send one as 'Authorization: Bearer KEY' " ..
  "or 'x-api-key: KEY'"
-- Envoy's own replies without a text (the endpoint picker unreachable, ...).
local EMPTY_ERRORS = {
  [500] = "internal error at the HTTP edge",
  [502] = "the upstream answered with something that is not a valid response",
  [503] = "the service is unavailable: its upstream (the gateway, or the endpoint picker) " ..
    "could not be reached",
  [504] = "the upstream did not answer in time",
}
local PROBE_DOWN = "no replica can serve now: the upstream is down, or none of its replicas " ..
  "is ready"

-- The length of the UTF-8 sequence (or JSON escape) that starts at byte i of text.
local function step_at(text, i, json_escaped)
  local byte = string.byte(text, i)
  if json_escaped and byte == 92 then  -- a backslash: \uXXXX or \x
    return string.sub(text, i + 1, i + 1) == "u" and 6 or 2
  end
  if byte >= 0xF0 then return 4 end
  if byte >= 0xE0 then return 3 end
  if byte >= 0xC0 then return 2 end
  return 1
end

-- text cut to at most limit bytes on a character (and escape) boundary, "..." marking a cut.
local function clip(text, limit, json_escaped)
  if #text <= limit then
    return text
  end
  local i = 1
  while i <= #text do
    local step = step_at(text, i, json_escaped)
    if i + step - 1 > limit - 3 then
      break
    end
    i = i + step
  end
  return string.sub(text, 1, i - 1) .. "..."
end

local function json_string(text)
  local escaped = string.gsub(clip(text, MAX_MESSAGE_BYTES, false), '[%c"\\]', function(c)
    if c == '"' then return '\\"' end
    if c == "\\" then return "\\\\" end
    if c == "\n" then return "\\n" end
    if c == "\t" then return "\\t" end
    return string.format("\\u%04x", string.byte(c))
  end)
  return '"' .. escaped .. '"'
end

local function error_type(status)
  if status == 401 then return "authentication_error" end
  if status == 403 then return "permission_error" end
  if status == 404 then return "not_found_error" end
  if status == 429 then return "rate_limit_error" end
  if status >= 500 then return "server_error" end
  return "invalid_request_error"
end

-- message: a JSON string literal; code, param: JSON literals (param null when absent).
local function openai_error_body(status, message, code, param)
  return '{"error":{"message":' .. message .. ',"type":"' .. error_type(status) ..
    '","param":' .. (param or "null") .. ',"code":' .. code .. '}}'
end

-- A google.rpc.ErrorInfo field of the status's details (the server's own identifiers:
-- letters, digits, "_", "." and "[]"), as a JSON string literal, or nil.
local function error_info_field(text, pattern)
  local value = string.match(text, pattern)
  if value ~= nil and #value <= 64 then
    return '"' .. value .. '"'
  end
  return nil
end

local function refuse(handle, grpc, status, message)
  -- Marked: deploy/envoy_config.py's local-reply mapper rewrites the codec's own 431 only.
  handle:streamInfo():dynamicMetadata():set(NAMESPACE, "edge_refusal", true)
  if grpc then
    handle:respond({[":status"] = "200", ["content-type"] = "application/grpc",
                    ["grpc-status"] = tostring(INVALID_ARGUMENT), ["grpc-message"] = message},
                   nil)
  else
    handle:respond({[":status"] = tostring(status), ["content-type"] = "application/json"},
                   openai_error_body(status, json_string(message), "null"))
  end
end

-- The request's header bytes as an HTTP/2 peer counts them (name, value and 32 bytes each),
-- the path apart (it has its own limit, and the transcoder replaces it).
local function header_bytes(headers)
  local total = 0
  for name, value in pairs(headers) do
    if name ~= ":path" then
      total = total + #name + #value + 32
    end
  end
  return total
end

-- Checks the URL's and the headers' size; true when the request was refused.
local function refused_for_size(handle, headers, grpc)
  local path = headers:get(":path") or ""
  if #path > MAX_URL_BYTES then
    refuse(handle, grpc, 414, "the URL is " .. #path .. " bytes long; at most " ..
      MAX_URL_BYTES .. " are accepted")
    return true
  end
  local count = 0
  for _ in pairs(headers) do
    count = count + 1
  end
  if count > MAX_HEADER_COUNT then
    refuse(handle, grpc, 431, "the request has " .. count .. " header fields; at most " ..
      MAX_HEADER_COUNT .. " are accepted")
    return true
  end
  local size = header_bytes(headers)
  if size > MAX_HEADER_BYTES then
    refuse(handle, grpc, 431, "the request headers take " .. size .. " bytes; at most " ..
      MAX_HEADER_BYTES .. " are accepted")
    return true
  end
  return false
end

local function normalize_authorization(headers)
  local value = headers:get("authorization")
  if value == nil then
    return
  end
  local token = string.match(value, "^%s*[Bb][Ee][Aa][Rr][Ee][Rr]%s+(%S+)%s*$")
  if token == nil then
    headers:remove("authorization")
  elseif value ~= "Bearer " .. token then
    headers:replace("authorization", "Bearer " .. token)
  end
end

local function is_json(content_type)
  local media = string.lower(string.match(content_type, "^%s*([^;%s]*)") or "")
  return media == "" or media == "application/json"
    or string.find(media, "^application/[%w.-]+%+json$") ~= nil
end

-- gRPC proper (application/grpc, application/grpc+proto, ...), not gRPC-Web.
local function is_grpc(content_type)
  local media = string.lower(string.match(content_type, "^%s*([^;%s]*)") or "")
  return media == "application/grpc" or string.find(media, "^application/grpc%+") ~= nil
end

local function plain_list_keys(path)
  local start = string.find(path, "?", 1, true)
  if start == nil then
    return path
  end
  local query = string.sub(path, start)
  query = string.gsub(query, "%[%]=", "=")
  query = string.gsub(query, "%%5[Bb]%%5[Dd]=", "=")
  return string.sub(path, 1, start - 1) .. query
end

function envoy_on_request(handle)
  local headers = handle:headers()
  local grpc = is_grpc(headers:get("content-type") or "")
  if refused_for_size(handle, headers, grpc) then
    return
  end
  normalize_authorization(headers)
  if grpc then
    return
  end
  local meta = handle:streamInfo():dynamicMetadata()
  meta:set(NAMESPACE, "http", true)
  local path = headers:get(":path")
  local bare = string.match(path, "^[^?]*")  -- a query does not change the route
  local method = headers:get(":method")
  if PROBE_PATHS[bare] then
    meta:set(NAMESPACE, "probe", true)
    return
  end
  if method == "POST" and JSON_BODY_PATHS[bare] then
    if not is_json(headers:get("content-type") or "") then
      refuse(handle, false, 415, "the body of POST " .. bare .. " is JSON: send it with " ..
        "Content-Type: application/json")
      return
    end
    -- One spelling, the one json_to_metadata reads (it compares the whole value).
    headers:replace("content-type", "application/json")
  end
  local plain = plain_list_keys(path)
  if plain ~= path then
    headers:replace(":path", plain)
    handle:clearRouteCache()
  end
  local id, query = string.match(plain, "^/v1/responses/([^/:?]+)%?(.*)$")
  if id ~= nil and method == "GET" and string.find("&" .. query .. "&", "&stream=true&", 1, true) then
    headers:replace(":path", "/v1/responses/" .. id .. ":stream?" .. query)
    handle:clearRouteCache()
    meta:set(NAMESPACE, "stream", true)
  end
end

-- The value of a string field in a flat JSON object, still JSON-escaped (so that it can be
-- embedded as is), or nil.
local function raw_string_field(text, name)
  local _, stop = string.find(text, '"' .. name .. '"%s*:%s*"')
  if stop == nil then
    return nil
  end
  local i = stop + 1
  while i <= #text do
    local c = string.sub(text, i, i)
    if c == "\\" then
      i = i + 2
    elseif c == '"' then
      return string.sub(text, stop + 1, i - 1)
    else
      i = i + 1
    end
  end
  return nil
end

local function openai_error(status, text, content_type, probe)
  local message, code, param = nil, "null", nil
  if status == 401 then
    return openai_error_body(status, json_string(API_KEY_HELP), '"invalid_api_key"')
  end
  if probe and status == 503 then
    return openai_error_body(status, json_string(PROBE_DOWN), '"unavailable"')
  end
  if string.find(content_type, "json", 1, true) then
    -- google.rpc.Status as the transcoder prints it: {"code": N, "message": "..."}
    local raw = raw_string_field(text, "message")
    if raw ~= nil then
      message = '"' .. clip(raw, MAX_MESSAGE_BYTES, true) .. '"'
    end
    local grpc_code = tonumber(string.match(text, '"code"%s*:%s*(%d+)'))
    if grpc_code ~= nil and GRPC_CODES[grpc_code] ~= nil then
      code = '"' .. GRPC_CODES[grpc_code] .. '"'
    end
    -- {"details": [{"@type": ".../google.rpc.ErrorInfo", "reason": R, "metadata": {"param": P}}]}
    code = error_info_field(text, '"reason"%s*:%s*"([%w_]+)"') or code
    param = error_info_field(text, '"param"%s*:%s*"([%w_%.%[%]]+)"')
  end
  if message == nil then
    text = string.gsub(text, "^%s+", "")
    text = string.gsub(text, "%s+$", "")
    if text == "" then
      text = EMPTY_ERRORS[status] or ("HTTP " .. status)
    end
    message = json_string(text)
  end
  return openai_error_body(status, message, code, param)
end

function envoy_on_response(handle)
  local meta = handle:streamInfo():dynamicMetadata():get(NAMESPACE)
  if meta == nil or not meta["http"] then
    return
  end
  local headers = handle:headers()
  for _, name in ipairs({"grpc-status", "grpc-message", "grpc-accept-encoding"}) do
    headers:remove(name)
  end
  local status = tonumber(headers:get(":status")) or 0
  if status < 400 then
    if meta["stream"] then
      headers:replace("content-type", "text/event-stream")
      headers:replace("cache-control", "no-cache")
    end
    return
  end
  local content_type = headers:get("content-type") or ""
  local body = handle:body(true)
  local text = body:getBytes(0, body:length())
  if string.find(text, '^%s*{%s*"error"%s*:') then
    return  -- already OpenAI-shaped (Tandem's own routes, the endpoint picker's replies)
  end
  body:setBytes(openai_error(status, text, content_type, meta["probe"]))
  handle:headers():replace("content-type", "application/json")
end
