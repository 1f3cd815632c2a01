-- Moves a POST whose JSON body says "stream": true to its streaming RPC's path.
--
-- Runs after Envoy's json_to_metadata filter, which parsed the body as JSON (a real parser:
-- a "stream" key inside a string, a nested object or an escaped quote is not the top-level
-- field) and put the top-level "stream" value, when there is one, under
-- tandem.openai/body_stream. deploy/envoy_config.py inlines this file after a prelude that
-- defines STREAM_PATHS (path -> its ":stream" path, for every POST rule of
-- tandem.v1.Generation that has a streaming twin, read from the descriptor set).
--
-- The streaming RPCs (the *Events ones) write the server-sent events themselves, each a
-- google.api.HttpBody the transcoder passes through, "data: [DONE]" last; openai_edge.lua
-- labels the response text/event-stream when it sees tandem.openai/stream set here.

local NAMESPACE = "tandem.openai"

function envoy_on_request(handle)
  local meta = handle:streamInfo():dynamicMetadata()
  local fields = meta:get(NAMESPACE)
  if fields == nil or fields["body_stream"] ~= true then
    return
  end
  local headers = handle:headers()
  if headers:get(":method") ~= "POST" then
    return
  end
  local bare, query = string.match(headers:get(":path"), "^([^?]*)(.*)$")
  local stream_path = STREAM_PATHS[bare]
  if stream_path == nil then
    return
  end
  headers:replace(":path", stream_path .. query)
  handle:clearRouteCache()
  meta:set(NAMESPACE, "stream", true)
end
