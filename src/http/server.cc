#include <fmt/core.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "core/cpu.h"
#include "core/host_port.h"
#include "core/json_fields.h"
#include "core/log.h"
#include "http/http.h"
#include "schema/openai_error.h"

namespace ferry::http {

namespace {

// A target's path without its query, runs of '/' as one: SGLang's mini_lb joins a URL that ends
// in '/' with "/generate" ("http://host:30001//generate"), which its own server takes.
std::string PathOf(const std::string& target) {
    std::string path = target.substr(0, target.find('?'));
    path.erase(
        std::unique(path.begin(), path.end(), [](char a, char b) { return a == '/' && b == '/'; }),
        path.end());
    return path;
}

}  // namespace

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = asio::ip::tcp;
using SteadyClock = std::chrono::steady_clock;

// The status line's reason phrase (RFC 9110's, as Beast knows them).
std::string_view Reason(int status) {
    const bhttp::status known = bhttp::int_to_status(static_cast<unsigned>(status));
    if (known == bhttp::status::unknown) return "Status";
    const beast::string_view r = bhttp::obsolete_reason(known);
    return {r.data(), r.size()};
}

std::string Head(int status, const std::string& content_type, const std::vector<Header>& headers,
                 bool keep_alive, std::optional<size_t> length) {
    std::string h = fmt::format("HTTP/1.1 {} {}\r\n", status, Reason(status));
    if (!content_type.empty()) h += fmt::format("Content-Type: {}\r\n", content_type);
    for (const Header& x : headers) {
        // A header value with a line break would forge headers: drop it.
        if (x.name.find_first_of("\r\n:") != std::string::npos ||
            x.value.find_first_of("\r\n") != std::string::npos) {
            continue;
        }
        h += fmt::format("{}: {}\r\n", x.name, x.value);
    }
    if (length) {
        h += fmt::format("Content-Length: {}\r\n", *length);
    } else {
        h += "Transfer-Encoding: chunked\r\n";
    }
    h += keep_alive ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    return h;
}

}  // namespace

const std::string* FindHeader(const std::vector<Header>& headers, std::string_view name) {
    for (const Header& h : headers) {
        if (h.name.size() == name.size() &&
            std::equal(h.name.begin(), h.name.end(), name.begin(), [](char a, char b) {
                return std::tolower(static_cast<unsigned char>(a)) ==
                       std::tolower(static_cast<unsigned char>(b));
            })) {
            return &h.value;
        }
    }
    return nullptr;
}

class Session;

// Bytes of request bodies held, over all connections (ServerConfig::max_inflight_body_bytes).
// Shared with the exchanges, which may outlive their connection (a queued job holds one).
struct BodyBudget {
    const size_t limit;
    std::atomic<size_t> used{0};
    explicit BodyBudget(size_t limit) : limit(limit) {}
    // Takes `n` bytes unless that would pass the limit (then false; `*now` what was in use).
    bool Take(size_t n, size_t* now = nullptr) {
        size_t cur = used.load();
        do {
            if (cur + n > limit) {
                if (now) *now = cur;
                return false;
            }
        } while (!used.compare_exchange_weak(cur, cur + n));
        return true;
    }
    void Give(size_t n) { used -= n; }
};

struct Server::Impl {
    ServerConfig cfg;
    std::shared_ptr<BodyBudget> budget;
    std::vector<Route> routes;
    int port = 0;
    std::atomic<bool> stopping{false};
    std::mutex mu;
    std::map<Session*, std::weak_ptr<Session>> sessions;
    std::atomic<uint64_t> open{0}, accepted{0}, refused{0}, requests{0}, timed_out{0}, too_large{0},
        busy{0};
    // Declared last, destroyed first: sessions still queued in it go while the rest is alive.
    asio::io_context ioc;
    std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
    tcp::acceptor acceptor{ioc};
    // Every use of the acceptor (accepting again, Stop's close) runs on this strand: an accept's
    // completion re-arming it on one thread while Stop closed it on another was a data race.
    asio::strand<asio::io_context::executor_type> accept_strand{asio::make_strand(ioc)};
    std::vector<std::thread> threads;

    http::Reply ErrorReply(int status, const std::string& message) const {
        if (cfg.error_reply) return cfg.error_reply(status, message);
        // OpenAI's error body (schema/openai_error.h), for a server that words none itself.
        return http::Reply{
            status, "application/json", DumpJson(schema::OpenAiErrorJson(status, {message})), {}};
    }
    void Accept();
};

// One connection. All its I/O runs on its strand.
class Session : public std::enable_shared_from_this<Session> {
  public:
    Session(Server::Impl* server, tcp::socket socket)
        : server_(server), stream_(std::move(socket)) {
        beast::error_code ec;
        auto ep = stream_.socket().remote_endpoint(ec);
        if (!ec) remote_ = FormatHostPort(ep.address().to_string(), ep.port());
    }
    ~Session() {
        std::lock_guard lock(server_->mu);
        server_->sessions.erase(this);
        --server_->open;
    }

    auto executor() { return stream_.get_executor(); }

    void Start() {
        auto first = server_->cfg.first_request_deadline.count() > 0
                         ? server_->cfg.first_request_deadline
                         : server_->cfg.request_deadline;
        deadline_ = SteadyClock::now() + first;
        ReadHeader();
    }

    // From any thread.
    void PostClose() {
        asio::post(stream_.get_executor(), [self = shared_from_this()] { self->Close(); });
    }

    // --- what an exchange asks for (on the strand) ---
    class Ex;
    void Enqueue(std::string bytes, bool last);
    size_t pending() const { return pending_.load(); }
    bool closed() const { return closed_.load(); }

  private:
    void ReadHeader() {
        parser_.emplace();
        parser_->header_limit(static_cast<uint32_t>(server_->cfg.max_header_bytes));
        // The route's limit is applied once the header says which route (OnHeader).
        parser_->body_limit(std::numeric_limits<std::uint64_t>::max());
        stream_.expires_at(deadline_);
        bhttp::async_read_header(
            stream_, buffer_, *parser_,
            [self = shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
    }

    void OnHeader(beast::error_code ec) {
        // A read that completed just before Close ran may be delivered after it.
        if (closed_) return;
        if (ec) return OnReadError(ec);
        const auto& h = parser_->get();
        std::string target(h.target());
        std::string path = PathOf(target);
        std::string method(h.method_string());
        route_ = nullptr;
        bool path_known = false;
        for (const Route& r : server_->routes) {
            if (r.path != path) continue;
            path_known = true;
            if (r.method == method) route_ = &r;
        }
        if (!route_) {
            keep_alive_ = false;
            return Refuse(path_known ? 405 : 404,
                          fmt::format("no such endpoint: {} {}", method, path.substr(0, 200)));
        }
        const size_t limit = route_->max_body ? route_->max_body : server_->cfg.max_body_bytes;
        parser_->body_limit(limit);
        auto len = parser_->content_length();
        if (len && *len > limit) {
            ++server_->too_large;
            keep_alive_ = false;
            return Refuse(413,
                          fmt::format("the body of {} bytes is larger than {} bytes", *len, limit));
        }
        if (route_->admit) {
            Request head;
            head.method = method;
            head.target = target;
            head.path = path;
            for (const auto& f : h) {
                head.headers.push_back({std::string(f.name_string()), std::string(f.value())});
            }
            head.remote = remote_;
            std::optional<http::Reply> refusal;
            try {
                refusal = route_->admit(head);
            } catch (const std::exception& e) {
                refusal = server_->ErrorReply(500, e.what());
            }
            if (refusal) {
                keep_alive_ = false;
                current_.reset();
                return Enqueue(Head(refusal->status, refusal->content_type, refusal->headers, false,
                                    refusal->body.size()) +
                                   refusal->body,
                               true);
            }
        }
        // The body budget: what this body may take, from now until the reply is out.
        size_t want = len ? static_cast<size_t>(*len) : (parser_->chunked() ? limit : 0);
        if (want > 0) {
            size_t cur = 0;
            if (!server_->budget->Take(want, &cur)) {
                ++server_->busy;
                keep_alive_ = false;
                return Refuse(503, fmt::format("busy: {} bytes of request bodies are in "
                                               "flight (at most {}); retry later",
                                               cur, server_->cfg.max_inflight_body_bytes));
            }
            body_reserved_ = want;
        }
        bhttp::async_read(
            stream_, buffer_, *parser_,
            [self = shared_from_this()](beast::error_code ec, size_t) { self->OnBody(ec); });
    }

    void OnReadError(beast::error_code ec) {
        if (ec == beast::error::timeout) {
            ++server_->timed_out;
            return Close();
        }
        if (ec == bhttp::error::body_limit) {
            ++server_->too_large;
            keep_alive_ = false;
            return Refuse(413, "the body is larger than this endpoint takes");
        }
        if (ec == bhttp::error::header_limit) {
            keep_alive_ = false;
            return Refuse(431, "the request headers are too large");
        }
        if (ec.category() == bhttp::make_error_code(bhttp::error::bad_target).category() &&
            ec != bhttp::error::end_of_stream && ec != bhttp::error::partial_message) {
            keep_alive_ = false;
            return Refuse(400, fmt::format("malformed request: {}", ec.message()));
        }
        Close();  // the client closed, or a socket error
    }

    void OnBody(beast::error_code ec);

    // While a handler works, a client that closes its end is noticed at once.
    void WatchClose() {
        stream_.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this()](
                                                                beast::error_code ec) {
            if (ec || self->closed_ || !self->current_ || self->replied_) return;
            char c;
            ssize_t n =
                ::recv(self->stream_.socket().native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
                return self->Close();
            }
            // Woken with nothing to read: watch again. n > 0: the client sent more (a
            // pipelined request), read after this reply.
            if (n < 0) self->WatchClose();
        });
    }

    void Refuse(int status, const std::string& message) {
        http::Reply r = server_->ErrorReply(status, message);
        replied_ = false;
        current_.reset();
        Enqueue(Head(r.status, r.content_type, r.headers, false, r.body.size()) + r.body, true);
    }

    void DoWrite() {
        if (writing_ || out_.empty() || closed_) return;
        writing_ = true;
        asio::async_write(stream_.socket(), asio::buffer(out_.front()),
                          [self = shared_from_this()](beast::error_code ec, size_t n) {
                              self->writing_ = false;
                              self->pending_ -= n;
                              // Closed meanwhile (a deadline, the client's hang-up, Stop):
                              // out_ is already cleared, even if this write got through.
                              if (ec || self->closed_) return self->Close();
                              self->out_.pop_front();
                              if (!self->out_.empty()) return self->DoWrite();
                              if (self->last_queued_) self->AfterReply();
                          });
    }

    // The body's reservation while it is being read (once a handler has it, its exchange holds
    // it: Ex::ReleaseBudget).
    void ReleaseBody() {
        if (body_reserved_ > 0) server_->budget->Give(body_reserved_);
        body_reserved_ = 0;
    }

    void AfterReply() {
        ReleaseBody();
        ReleaseExchangeBudget();
        last_queued_ = false;
        replied_ = false;
        current_.reset();
        hold_.reset();
        if (!keep_alive_ || server_->stopping) {
            beast::error_code ec;
            stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
            return Close();
        }
        deadline_ = SteadyClock::now() + server_->cfg.request_deadline;
        ReadHeader();
    }

  public:
    void Close();
    void ReleaseExchangeBudget();  // the current exchange's body, once its reply is out

  private:
    Server::Impl* server_;
    beast::tcp_stream stream_;
    beast::flat_buffer buffer_;
    std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
    const Route* route_ = nullptr;
    std::string remote_;
    SteadyClock::time_point deadline_;
    bool keep_alive_ = true;
    size_t body_reserved_ = 0;  // of Impl::budget, while the body is read
    std::shared_ptr<Ex> current_;
    // While an exchange is pending no I/O of ours may be outstanding (a handler answers later):
    // the session keeps itself alive until the reply is out or the connection closes.
    std::shared_ptr<Session> hold_;
    bool replied_ = false;      // the current exchange queued its last bytes
    bool last_queued_ = false;  // the reply ends with what is queued
    std::deque<std::string> out_;
    bool writing_ = false;
    std::atomic<size_t> pending_{0};
    std::atomic<bool> closed_{false};
};

class Session::Ex : public Exchange {
  public:
    Ex(std::shared_ptr<Session> s, Request r) : session_(s), request_(std::move(r)) {}
    ~Ex() override { ReleaseBudget(); }

    void HoldBudget(std::shared_ptr<BodyBudget> budget, size_t bytes) {
        budget_ = std::move(budget);
        held_ = bytes;
    }
    bool ReserveBody(size_t bytes) override {
        if (!budget_ || bytes == 0) return true;
        std::lock_guard lock(budget_mu_);
        if (released_ || !budget_->Take(bytes)) return false;
        held_ += bytes;
        return true;
    }
    // Once: the reply is out, or the exchange goes.
    void ReleaseBudget() {
        std::lock_guard lock(budget_mu_);
        if (released_ || !budget_) return;
        released_ = true;
        budget_->Give(held_);
        held_ = 0;
    }

    const Request& request() const override { return request_; }

    void Reply(http::Reply reply) override {
        if (started_.exchange(true)) return;
        bool keep = FindHeader(request_.headers, "connection") == nullptr ||
                    *FindHeader(request_.headers, "connection") != "close";
        if (const std::string* c = FindHeader(reply.headers, "connection")) {
            if (*c == "close") keep = false;
            reply.headers.erase(std::remove_if(reply.headers.begin(), reply.headers.end(),
                                               [](const Header& h) {
                                                   return FindHeader({h}, "connection") != nullptr;
                                               }),
                                reply.headers.end());
        }
        std::string bytes =
            Head(reply.status, reply.content_type, reply.headers, keep, reply.body.size()) +
            reply.body;
        Post(std::move(bytes), true, !keep);
    }
    void StartStream(int status, std::string content_type, std::vector<Header> headers) override {
        if (started_.exchange(true)) return;
        streaming_ = true;
        Post(Head(status, content_type, headers, true, std::nullopt), false);
    }
    bool Write(std::string bytes) override {
        if (!streaming_ || ended_ || closed()) return false;
        if (bytes.empty()) return true;
        Post(fmt::format("{:x}\r\n", bytes.size()) + bytes + "\r\n", false);
        return true;
    }
    void End() override {
        if (!streaming_ || ended_.exchange(true)) return;
        Post("0\r\n\r\n", true);
    }
    void OnClose(std::function<void()> fn) override {
        std::unique_lock lock(mu_);
        if (close_fired_) {
            lock.unlock();
            fn();
            return;
        }
        on_close_ = std::move(fn);
    }
    bool closed() const override {
        auto s = session_.lock();
        return !s || s->closed();
    }
    size_t pending_bytes() const override {
        auto s = session_.lock();
        return s ? s->pending() : 0;
    }

    // The connection went before the reply was out.
    void FireClose() {
        std::function<void()> fn;
        {
            std::lock_guard lock(mu_);
            if (close_fired_) return;
            close_fired_ = true;
            fn = std::move(on_close_);
        }
        if (fn) fn();
    }
    bool finished() const { return finished_; }
    void MarkFinished() { finished_ = true; }

  private:
    std::mutex budget_mu_;
    std::shared_ptr<BodyBudget> budget_;
    size_t held_ = 0;
    bool released_ = false;

  public:
  private:
    void Post(std::string bytes, bool last, bool close_after = false) {
        auto s = session_.lock();
        if (!s) return;
        s->pending_ += bytes.size();
        asio::post(s->stream_.get_executor(),
                   [s, bytes = std::move(bytes), last, close_after]() mutable {
                       if (close_after) s->keep_alive_ = false;
                       s->Enqueue(std::move(bytes), last);
                   });
    }

    std::weak_ptr<Session> session_;
    Request request_;
    std::atomic<bool> started_{false}, ended_{false};
    bool streaming_ = false;
    std::atomic<bool> finished_{false};
    std::mutex mu_;
    bool close_fired_ = false;
    std::function<void()> on_close_;
};

void Session::OnBody(beast::error_code ec) {
    if (closed_) return;  // closed while this completion was queued: no handler, no hold_
    if (ec) return OnReadError(ec);
    stream_.expires_never();
    ++server_->requests;
    auto msg = parser_->release();
    Request req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    req.path = PathOf(req.target);
    for (const auto& f : msg) {
        req.headers.push_back({std::string(f.name_string()), std::string(f.value())});
    }
    req.body = std::move(msg.body());
    req.remote = remote_;
    keep_alive_ = msg.keep_alive();
    auto ex = std::make_shared<Ex>(shared_from_this(), std::move(req));
    // The body's bytes stay counted while the exchange holds them: until the reply is out, or,
    // for a client that left, until whatever still holds the exchange (a queued job) lets go.
    ex->HoldBudget(server_->budget, body_reserved_);
    body_reserved_ = 0;
    current_ = ex;
    hold_ = shared_from_this();
    WatchClose();
    try {
        route_->handler(ex);
    } catch (const std::exception& e) {
        ex->Reply(server_->ErrorReply(500, e.what()));
    } catch (...) {
        ex->Reply(server_->ErrorReply(500, "internal error"));
    }
}

void Session::ReleaseExchangeBudget() {
    if (current_) current_->ReleaseBudget();
}

void Session::Enqueue(std::string bytes, bool last) {
    if (closed_) {
        pending_ -= bytes.size();
        return;
    }
    out_.push_back(std::move(bytes));
    if (last) {
        last_queued_ = true;
        replied_ = true;
        if (current_) current_->MarkFinished();
    }
    DoWrite();
}

void Session::Close() {
    if (closed_.exchange(true)) return;
    ReleaseBody();
    beast::error_code ec;
    stream_.socket().close(ec);
    if (current_ && !current_->finished()) current_->FireClose();
    current_.reset();
    out_.clear();
    hold_.reset();  // the last reference may be this: nothing below touches the session
}

void Server::Impl::Accept() {
    acceptor.async_accept(
        asio::make_strand(ioc),
        asio::bind_executor(accept_strand, [this](beast::error_code ec, tcp::socket s) {
            if (ec) {
                if (!stopping && ec != asio::error::operation_aborted) {
                    FERRY_LOG(kWarn, "{}: accept: {}", cfg.name, ec.message());
                    // Out of descriptors and the like: back off a little instead of spinning.
                    std::this_thread::sleep_for(std::chrono::milliseconds(5));
                    Accept();
                }
                return;
            }
            ++accepted;
            if (open.load() >= cfg.max_connections || stopping) {
                ++refused;
                beast::error_code ignore;
                s.close(ignore);
                return Accept();
            }
            ++open;
            auto session = std::make_shared<Session>(this, std::move(s));
            {
                // Stop sets `stopping` before it walks the map under this lock: a session put in
                // after that walk sees `stopping` here, and is not started (it would never be
                // closed, and a hanging handler would keep it alive past Stop).
                std::lock_guard lock(mu);
                sessions[session.get()] = session;
                if (stopping) {
                    ++refused;
                    session->PostClose();
                    return;
                }
            }
            asio::post(session->executor(), [session] { session->Start(); });
            Accept();
        }));
}

Server::Server(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Server>> Server::Start(ServerConfig cfg, std::vector<Route> routes) {
    if (cfg.port < 0 || cfg.port > 65535) {
        return InvalidArgumentError(fmt::format("{}: port {} is not 0..65535", cfg.name, cfg.port));
    }
    if (cfg.max_connections == 0 || cfg.io_threads < 0 || cfg.io_threads > 64) {
        return InvalidArgumentError(fmt::format("{}: bad connection or thread limits", cfg.name));
    }
    auto impl = std::make_shared<Impl>();
    impl->cfg = std::move(cfg);
    impl->routes = std::move(routes);
    impl->budget = std::make_shared<BodyBudget>(impl->cfg.max_inflight_body_bytes);
    const ServerConfig& c = impl->cfg;
    beast::error_code ec;
    std::string host = c.host == "localhost" ? "127.0.0.1" : c.host;
    auto addr = asio::ip::make_address(host, ec);
    if (ec) {
        return InvalidArgumentError(
            fmt::format("{}: listen address '{}' is not an IP address", c.name, c.host));
    }
    tcp::endpoint ep(addr, static_cast<uint16_t>(c.port));
    impl->acceptor.open(ep.protocol(), ec);
    if (!ec) impl->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) impl->acceptor.bind(ep, ec);
    if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
        return UnavailableError(fmt::format("{}: cannot listen on {}: {}", c.name,
                                            FormatHostPort(c.host, c.port), ec.message()));
    }
    impl->port = impl->acceptor.local_endpoint().port();
    impl->work.emplace(asio::make_work_guard(impl->ioc));
    impl->Accept();
    int n = c.io_threads > 0 ? c.io_threads : std::clamp(UsableCores(), 1, 4);
    for (int i = 0; i < n; ++i) {
        impl->threads.emplace_back([p = impl.get()] { p->ioc.run(); });
    }
    return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::~Server() { Stop(); }

int Server::port() const { return impl_->port; }

ServerStats Server::Stats() const {
    ServerStats s;
    s.connections_open = impl_->open;
    s.connections_accepted = impl_->accepted;
    s.connections_refused = impl_->refused;
    s.requests = impl_->requests;
    s.timed_out = impl_->timed_out;
    s.too_large = impl_->too_large;
    s.busy = impl_->busy;
    s.inflight_body_bytes = impl_->budget->used;
    return s;
}

void Server::Stop() {
    Impl& m = *impl_;
    if (m.stopping.exchange(true)) return;
    asio::post(m.accept_strand, [p = &m] {
        beast::error_code ec;
        p->acceptor.close(ec);
    });
    // The sessions are taken under the lock and closed outside it: a session whose last
    // reference goes here runs ~Session, which takes the same lock (a self-deadlock once seen as
    // a store test hanging at teardown, after a refused connection closed during the walk).
    std::vector<std::shared_ptr<Session>> open_sessions;
    {
        std::lock_guard lock(m.mu);
        for (auto& [ptr, weak] : m.sessions) {
            if (auto s = weak.lock()) open_sessions.push_back(std::move(s));
        }
    }
    for (auto& s : open_sessions) s->PostClose();
    open_sessions.clear();
    auto until = SteadyClock::now() + std::chrono::seconds(2);
    while (SteadyClock::now() < until) {
        {
            std::lock_guard lock(m.mu);
            if (m.sessions.empty()) break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    m.work.reset();
    m.ioc.stop();
    for (auto& t : m.threads) t.join();
    m.threads.clear();
    // No I/O thread runs now. A session still here (its Close was queued behind the stop, or a
    // handler holds its exchange) is closed from this thread: its exchange hears OnClose and
    // the session drops the hold it has on itself, so nothing outlives the server.
    std::vector<std::shared_ptr<Session>> left;
    {
        std::lock_guard lock(m.mu);
        for (auto& [ptr, weak] : m.sessions) {
            if (auto s = weak.lock()) left.push_back(std::move(s));
        }
    }
    for (auto& s : left) s->Close();
    left.clear();
    // What is still queued (completions of the closed sockets, replies posted by handlers)
    // runs out here, on this thread, and lets go of the sessions it holds.
    m.ioc.restart();
    m.ioc.poll();
}

}  // namespace ferry::http
