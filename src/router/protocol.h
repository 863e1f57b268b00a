// The disaggregation protocols' HTTP messages as the router sends them (docs/disaggregation.md):
// the bodies each kind of worker gets, a prefill worker's agent, and OpenAI error replies.
// Written once: `ferry proxy` and decode-first workers both build their requests here. The
// objects inside them (kv_transfer_params, ec_transfer_params, an agent's address, the error
// body) have their one codec in src/schema/.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "http/http.h"
#include "router/router.h"
#include "schema/openai_error.h"

namespace ferry::router {

enum class Protocol {
    kPull,  // vLLM's NixlConnector protocol: prefill first, its params go to the decoder
    kPush,  // layer-wise: prefill and decode at once under a transfer id
};
const char* ProtocolName(Protocol protocol);

// Request bodies nesting deeper than this are refused before they are parsed.
inline constexpr size_t kMaxJsonDepth = 64;

// The one OpenAI error reply of every ferry server: schema::OpenAiErrorJson's body
// (schema/openai_error.h) with the status; with `request_id` the X-Request-Id header carries it.
using schema::OpenAiError;
http::Reply ErrorReply(int status, const OpenAiError& error, const std::string& request_id = "");
inline http::Reply ErrorReply(int status, const std::string& message,
                              const std::string& request_id = "") {
    return ErrorReply(status, OpenAiError{message}, request_id);
}
// The same error once a stream has started (its status line is sent): one server-sent event
// with the same body, then the stream's end ("data: [DONE]").
std::string ErrorEvent(int status, const OpenAiError& error, const std::string& request_id);

// The client's request as vLLM's proxies send it to a prefill worker: one token, not streamed.
nlohmann::json PrefillBody(nlohmann::json body);

// EPD: the image URLs of a chat body's messages, in order (views into `body`).
std::vector<std::string_view> ImageUrls(const nlohmann::json& body);
// EPD: the encode worker for a request's images (their URLs): the highest rendezvous hash, so
// the same images meet the same worker (and its encoder cache) while the set of workers stays.
// `encoders` is not empty.
size_t PickEncoder(const std::vector<std::string_view>& urls,
                   const std::vector<http::Endpoint>& encoders);

// A worker's GET /v1/kv/agent answer; Unavailable naming the worker when it has no agent.
Result<AgentInfo> ParseAgentInfo(int status, const std::string& body, const http::Endpoint& worker);

// Where `worker`'s transfer agent is: from the router when known (or its discovery store has the
// worker's record), else asked of the worker (GET /v1/kv/agent, with the router token when there
// is one) within `timeout` (DeadlineExceeded after it) and remembered. `done` runs once, on
// this thread when the agent is known, else on an I/O thread of `client`. The call, if one was
// made (cancel it to stop waiting; `done` then gets Cancelled).
std::shared_ptr<http::ClientCall> FindAgent(http::Client& client, std::shared_ptr<Router> router,
                                            Role role, size_t worker,
                                            const std::string& router_token,
                                            std::chrono::milliseconds timeout,
                                            std::function<void(Result<AgentInfo>)> done);

// "Authorization: Bearer <token>" on a call to a worker, when there is a token.
void Authorize(http::ClientRequest* request, const std::string& router_token);

// How a worker's HTTP status ends its ticket.
Outcome OutcomeOfStatus(int status);

}  // namespace ferry::router
