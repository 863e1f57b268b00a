// ferry's one HTTP/1.1 layer, event-driven (Boost.Beast over Asio): a server where a fixed few
// I/O threads serve any number of connections (an idle one costs a socket and a few KiB, never a
// thread), and a client that streams responses the same way. Both serve the OpenAI API of a
// worker, the proxy in front of workers, and the discovery store.
//
// Server: routes by method and path; a request must arrive whole within `request_deadline` of
// the connection opening or of the previous response (slowloris), with headers within
// `max_header_bytes` and a body within the route's limit (413 before the body is read). A
// handler gets the exchange as a shared_ptr and may answer later from any thread: whole
// (Reply) or streamed in chunks (StartStream / Write / End, e.g. server-sent events). While a
// handler works the connection has no deadline, and a client that closes its end is noticed at
// once (OnClose), so work done for it can be stopped. Keep-alive is honoured.
//
// Handlers must not block: an engine's work happens elsewhere and answers through the exchange.
// Thread-safety: Server is started and stopped from one thread; Exchange methods may be called
// from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/host_port.h"
#include "ferry/status.h"

namespace ferry::http {

struct Header {
    std::string name;
    std::string value;
};

// Case-insensitive lookup; null if absent.
const std::string* FindHeader(const std::vector<Header>& headers, std::string_view name);

struct Request {
    std::string method;  // "GET", "POST", ...
    std::string target;  // as sent: "/v1/completions?x=1"
    std::string path;    // without the query
    std::vector<Header> headers;
    std::string body;
    std::string remote;  // "addr:port" of the client
    const std::string* Find(std::string_view name) const { return FindHeader(headers, name); }
};

struct Reply {
    int status = 200;
    std::string content_type = "application/json";
    std::string body;
    std::vector<Header> headers;
};

// One request being answered.
class Exchange {
  public:
    virtual ~Exchange() = default;
    virtual const Request& request() const = 0;
    // The whole reply. Only the first Reply or StartStream counts; later calls are ignored. A
    // "Connection: close" header in it closes the connection after it.
    virtual void Reply(http::Reply reply) = 0;
    // Starts a streamed reply (chunked transfer encoding).
    virtual void StartStream(int status, std::string content_type,
                             std::vector<Header> headers = {}) = 0;
    // Queues bytes of the stream. False once the connection is gone (the bytes are dropped).
    virtual bool Write(std::string bytes) = 0;
    // Ends the stream.
    virtual void End() = 0;
    // `fn` runs once, on an I/O thread, if the connection closes before the reply has been
    // written (the client went away, or the server stops); at once if that already happened.
    virtual void OnClose(std::function<void()> fn) = 0;
    virtual bool closed() const = 0;
    // Bytes queued and not yet written (a stream's backpressure).
    virtual size_t pending_bytes() const = 0;
    // Counts `bytes` more against the server's body budget (ServerConfig::
    // max_inflight_body_bytes) for as long as the request's body is: copies of it a handler
    // keeps while the request waits. False, with nothing taken, if that would pass the budget
    // (the handler should answer 503). Released with the body's own bytes: when the reply is
    // out, or when the last holder of the exchange lets it go (a client that left).
    virtual bool ReserveBody(size_t bytes) {
        (void)bytes;
        return true;
    }
};

using Handler = std::function<void(std::shared_ptr<Exchange>)>;

struct Route {
    std::string method;
    std::string path;
    Handler handler;
    size_t max_body = 0;  // 0: ServerConfig::max_body_bytes
    // Runs on the head (method, target, headers, remote; no body) before any of the body is
    // read: a reply refuses the request (and closes the connection), nullopt admits it. For
    // checks that need no body, so that strangers cannot make the server read bodies.
    std::function<std::optional<http::Reply>(const Request& head)> admit{};
};

struct ServerConfig {
    std::string name = "http";  // in log lines
    std::string host = "127.0.0.1";
    int port = 0;        // 0: any free port
    int io_threads = 0;  // 0: one per core, 1..4
    // Open connections at most; one more is accepted and closed at once.
    size_t max_connections = 65536;
    size_t max_body_bytes = 1u << 20;
    size_t max_header_bytes = 16u << 10;
    std::chrono::milliseconds request_deadline{10000};
    // The deadline of a connection's first request (0: request_deadline): a short grace for
    // servers whose clients authenticate, so unauthenticated sockets do not linger.
    std::chrono::milliseconds first_request_deadline{0};
    // Bytes of request bodies being read or handled, over all connections (the Content-Length,
    // or the route's limit for a chunked body, counts from the moment the head is in until the
    // reply is out, or until its exchange is let go when the client left first; with what
    // handlers add, Exchange::ReserveBody): a request over it gets 503 before its body is read.
    size_t max_inflight_body_bytes = 256u << 20;
    // The body of a refusal the server makes itself (400, 404, 405, 413, 503): default JSON
    // {"error": {"message": ...}}.
    std::function<http::Reply(int status, const std::string& message)> error_reply;
};

struct ServerStats {
    uint64_t connections_open = 0;
    uint64_t connections_accepted = 0;
    uint64_t connections_refused = 0;  // over max_connections
    uint64_t requests = 0;
    uint64_t timed_out = 0;  // closed for not delivering a request in time
    uint64_t too_large = 0;  // 413
    uint64_t busy = 0;       // 503 for the body budget
    uint64_t inflight_body_bytes = 0;
};

class Server {
  public:
    // Binds and starts the I/O threads. Unavailable if the address cannot be bound,
    // InvalidArgument for a bad config.
    static Result<std::unique_ptr<Server>> Start(ServerConfig config, std::vector<Route> routes);
    ~Server();  // Stop()
    Server(const Server&) = delete;
    Server& operator=(const Server&) = delete;

    int port() const;
    ServerStats Stats() const;
    // Stops accepting, closes every connection (their OnClose callbacks run), joins the threads.
    void Stop();

    struct Impl;

  private:
    explicit Server(std::shared_ptr<Impl> impl);
    std::shared_ptr<Impl> impl_;
};

// --- client ---------------------------------------------------------------------------------

struct ClientRequest {
    std::string method = "POST";
    std::string host = "127.0.0.1";
    int port = 0;
    std::string target = "/";
    std::vector<Header> headers;
    std::string body;
    std::string content_type = "application/json";
    // The whole exchange, connect to last byte (0: none).
    std::chrono::milliseconds timeout{0};
    // Once the body started, the longest wait for each next piece of it (0: none): a stream
    // whose sender stalls fails DeadlineExceeded then (`timeout` still bounds the whole call).
    // Before the first piece only `timeout` counts (a server may think long before it answers).
    std::chrono::milliseconds idle_timeout{0};
};

// A GET of `target` at host:port, `timeout` for the whole exchange.
ClientRequest GetRequest(std::string host, int port, std::string target,
                         std::chrono::milliseconds timeout);
// A POST of `body` (application/json) to `target` at `ep`; no timeout set.
ClientRequest PostRequest(const HostPort& ep, std::string target, std::string body);

struct ClientHead {
    int status = 0;
    std::vector<Header> headers;
};

// Callbacks of one call, each on an I/O thread: on_head once, on_data for each piece of the
// body as it arrives (chunked encoding decoded), on_done once at the end with OK or the error
// (Unavailable: connect or read failed; DeadlineExceeded; Cancelled).
struct ClientCallbacks {
    std::function<void(const ClientHead&)> on_head;
    std::function<void(std::string_view)> on_data;
    std::function<void(const Status&)> on_done;
};

class ClientCall {
  public:
    virtual ~ClientCall() = default;
    // Closes the connection; on_done gets Cancelled unless it already ran. A no-op once the
    // call is over or its Client is gone.
    virtual void Cancel() = 0;
};

// Streams requests over fresh connections on a few I/O threads of its own. Destroying it stops
// its calls: callbacks not run by then never run.
struct ClientReply;

class Client {
  public:
    static std::unique_ptr<Client> Create(int io_threads = 1);
    ~Client();
    std::shared_ptr<ClientCall> Call(ClientRequest request, ClientCallbacks callbacks);
    // The whole answer (body up to `max_body` bytes kept) to `done`, on an I/O thread.
    std::shared_ptr<ClientCall> CallWhole(ClientRequest request,
                                          std::function<void(Result<ClientReply>)> done,
                                          size_t max_body = 64u << 20);

    struct Impl;

  private:
    explicit Client(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

// A whole response, for callers that can block (tests, command-line tools).
struct ClientReply {
    int status = 0;
    std::vector<Header> headers;
    std::string body;
};
Result<ClientReply> Fetch(const ClientRequest& request);
// A blocking call whose body goes to `on_data` on the caller's thread as it arrives (the
// reply's body stays empty then; without on_data it collects up to 64 MiB). `on_data` returning
// false ends the call early with what came. The head must come within `head_timeout`
// (Unavailable otherwise); after it, `idle` bounds the silence between pieces, and hitting it
// ends the call normally (a long poll with no news). request.timeout is not used.
Result<ClientReply> FetchStreaming(const ClientRequest& request,
                                   std::chrono::milliseconds head_timeout,
                                   std::chrono::milliseconds idle,
                                   const std::function<bool(std::string_view)>& on_data);

// "host:port" or "http://host:port[/...]" -> host and port (core/host_port.h's type and parser).
using Endpoint = ::ferry::HostPort;
Result<Endpoint> ParseEndpoint(std::string_view url);
// A server's root as a client names it (`--base-url`): "http://host[:port]" with port 80 by
// default and no path (a trailing '/' is allowed). InvalidArgument naming the text and what is
// wrong: another scheme, a path, no host, a bad port.
Result<Endpoint> ParseServerUrl(std::string_view url);
// "host:port" to listen on: port 0..65535 (0: any free port). InvalidArgument naming the text.
Result<Endpoint> ParseListenAddress(std::string_view address);

}  // namespace ferry::http
