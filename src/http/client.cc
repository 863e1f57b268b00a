#include <fmt/core.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "core/host_port.h"
#include "http/http.h"

namespace ferry::http {

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = asio::ip::tcp;

constexpr size_t kReadPiece = 64u << 10;

// One call's I/O objects; owned by its pending handlers only, so they go with the io_context
// (a handle the caller keeps must not keep them past it).
class CallImpl : public std::enable_shared_from_this<CallImpl> {
  public:
    CallImpl(asio::io_context& ioc, ClientRequest req, ClientCallbacks cb)
        : strand_(asio::make_strand(ioc)),
          resolver_(strand_),
          stream_(strand_),
          request_(std::move(req)),
          cb_(std::move(cb)) {}

    void Start() {
        asio::post(strand_, [self = shared_from_this()] { self->Resolve(); });
    }

    void Cancel() {
        asio::post(strand_, [self = shared_from_this()] {
            self->Finish(CancelledError("http: call cancelled"));
        });
    }

  private:
    void Resolve() {
        if (request_.timeout.count() > 0) {
            deadline_ = std::chrono::steady_clock::now() + request_.timeout;
            stream_.expires_at(deadline_);
        }
        resolver_.async_resolve(
            request_.host, std::to_string(request_.port),
            [self = shared_from_this()](beast::error_code ec, tcp::resolver::results_type r) {
                if (ec) return self->Fail("resolve", ec);
                self->stream_.async_connect(r, [self](beast::error_code ec, const tcp::endpoint&) {
                    if (ec) return self->Fail("connect", ec);
                    self->Send();
                });
            });
    }

    void Send() {
        req_.method_string(request_.method);
        req_.target(request_.target);
        req_.version(11);
        req_.set(bhttp::field::host, FormatHostPort(request_.host, request_.port));
        req_.set(bhttp::field::connection, "close");
        for (const Header& h : request_.headers) req_.set(h.name, h.value);
        if (!request_.body.empty() || request_.method == "POST" || request_.method == "PUT") {
            req_.set(bhttp::field::content_type, request_.content_type);
            req_.body() = std::move(request_.body);
            req_.prepare_payload();
        }
        bhttp::async_write(stream_, req_,
                           [self = shared_from_this()](beast::error_code ec, size_t) {
                               if (ec) return self->Fail("write", ec);
                               self->parser_.body_limit(boost::none);
                               bhttp::async_read_header(
                                   self->stream_, self->buffer_, self->parser_,
                                   [self](beast::error_code ec, size_t) { self->OnHead(ec); });
                           });
    }

    void OnHead(beast::error_code ec) {
        if (ec) return Fail("read", ec);
        if (done_) return;
        ClientHead head;
        const auto& msg = parser_.get();
        head.status = static_cast<int>(msg.result_int());
        for (const auto& f : msg) {
            head.headers.push_back({std::string(f.name_string()), std::string(f.value())});
        }
        if (cb_.on_head) cb_.on_head(head);
        ReadBody();
    }

    void ReadBody() {
        if (done_) return;
        if (parser_.is_done()) return Finish(Status::Ok());
        if (request_.idle_timeout.count() > 0 && body_started_) {
            // The next piece within the idle deadline, or the whole call's if that comes first.
            const auto idle = std::chrono::steady_clock::now() + request_.idle_timeout;
            idle_armed_ = request_.timeout.count() <= 0 || idle < deadline_;
            stream_.expires_at(idle_armed_ ? idle : deadline_);
        }
        piece_.resize(kReadPiece);
        parser_.get().body().data = piece_.data();
        parser_.get().body().size = piece_.size();
        bhttp::async_read_some(stream_, buffer_, parser_,
                               [self = shared_from_this()](beast::error_code ec, size_t) {
                                   if (ec == bhttp::error::need_buffer) ec = {};
                                   if (ec) return self->Fail("read", ec);
                                   size_t n = self->piece_.size() - self->parser_.get().body().size;
                                   if (n > 0) self->body_started_ = true;
                                   if (n > 0 && self->cb_.on_data && !self->done_) {
                                       self->cb_.on_data(std::string_view(self->piece_.data(), n));
                                   }
                                   self->ReadBody();
                               });
    }

    void Fail(const char* what, beast::error_code ec) {
        if (ec == beast::error::timeout && idle_armed_) {
            return Finish(DeadlineExceededError(
                fmt::format("http {}{}: the answer stalled: no data for {} ms",
                            FormatHostPort(request_.host, request_.port), request_.target,
                            request_.idle_timeout.count())));
        }
        if (ec == beast::error::timeout) {
            return Finish(DeadlineExceededError(fmt::format(
                "http {}{}: no answer within {} ms", FormatHostPort(request_.host, request_.port),
                request_.target, request_.timeout.count())));
        }
        Finish(UnavailableError(fmt::format("http {}{}: {}: {}",
                                            FormatHostPort(request_.host, request_.port),
                                            request_.target, what, ec.message())));
    }

    void Finish(Status st) {
        if (done_) return;
        done_ = true;
        beast::error_code ignore;
        stream_.socket().shutdown(tcp::socket::shutdown_both, ignore);
        stream_.close();
        if (cb_.on_done) cb_.on_done(st);
        cb_ = {};
    }

    asio::strand<asio::io_context::executor_type> strand_;
    tcp::resolver resolver_;
    beast::tcp_stream stream_;
    ClientRequest request_;
    ClientCallbacks cb_;
    bhttp::request<bhttp::string_body> req_;
    beast::flat_buffer buffer_;
    bhttp::response_parser<bhttp::buffer_body> parser_;
    std::vector<char> piece_;
    bool done_ = false;
    std::chrono::steady_clock::time_point deadline_;  // of the whole call, when it has one
    bool idle_armed_ = false;                         // the timer now is the idle deadline
    bool body_started_ = false;                       // a first piece of the body came
};

// What the caller holds: a weak reference.
class Handle : public ClientCall {
  public:
    explicit Handle(std::weak_ptr<CallImpl> call) : call_(std::move(call)) {}
    void Cancel() override {
        if (auto c = call_.lock()) c->Cancel();
    }

  private:
    std::weak_ptr<CallImpl> call_;
};

}  // namespace

struct Client::Impl {
    asio::io_context ioc;
    std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
    std::vector<std::thread> threads;
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<Client> Client::Create(int io_threads) {
    auto impl = std::make_unique<Impl>();
    impl->work.emplace(asio::make_work_guard(impl->ioc));
    for (int i = 0; i < std::max(1, io_threads); ++i) {
        impl->threads.emplace_back([p = impl.get()] { p->ioc.run(); });
    }
    return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::~Client() {
    impl_->work.reset();
    impl_->ioc.stop();
    for (auto& t : impl_->threads) t.join();
}

std::shared_ptr<ClientCall> Client::Call(ClientRequest request, ClientCallbacks callbacks) {
    auto call = std::make_shared<CallImpl>(impl_->ioc, std::move(request), std::move(callbacks));
    call->Start();
    return std::make_shared<Handle>(call);
}

std::shared_ptr<ClientCall> Client::CallWhole(ClientRequest request,
                                              std::function<void(Result<ClientReply>)> done,
                                              size_t max_body) {
    auto reply = std::make_shared<ClientReply>();
    ClientCallbacks cb;
    cb.on_head = [reply](const ClientHead& h) {
        reply->status = h.status;
        reply->headers = h.headers;
    };
    cb.on_data = [reply, max_body](std::string_view d) {
        if (reply->body.size() < max_body)
            reply->body.append(d.substr(0, max_body - reply->body.size()));
    };
    cb.on_done = [reply, done = std::move(done)](const Status& s) {
        if (!s.ok()) return done(s);
        done(std::move(*reply));
    };
    return Call(std::move(request), std::move(cb));
}

ClientRequest GetRequest(std::string host, int port, std::string target,
                         std::chrono::milliseconds timeout) {
    ClientRequest r;
    r.method = "GET";
    r.host = std::move(host);
    r.port = port;
    r.target = std::move(target);
    r.timeout = timeout;
    return r;
}

ClientRequest PostRequest(const HostPort& ep, std::string target, std::string body) {
    ClientRequest r;
    r.method = "POST";
    r.host = ep.host;
    r.port = ep.port;
    r.target = std::move(target);
    r.body = std::move(body);
    return r;
}

Result<ClientReply> Fetch(const ClientRequest& request) {
    // One client for every blocking call of the process (tools and tests).
    static Client* shared = Client::Create(1).release();
    auto done = std::make_shared<std::promise<Result<ClientReply>>>();
    auto fut = done->get_future();
    auto call = shared->CallWhole(request,
                                  [done](Result<ClientReply> r) { done->set_value(std::move(r)); });
    if (request.timeout.count() <= 0) return fut.get();
    // The call's own timer ends it; this bound holds even if its completion were lost, so no
    // caller of a timed call ever waits past its deadline (and a little grace).
    if (fut.wait_for(request.timeout + std::chrono::seconds(2)) == std::future_status::ready) {
        return fut.get();
    }
    call->Cancel();
    return DeadlineExceededError(fmt::format("http {}{}: no answer within {} ms",
                                             FormatHostPort(request.host, request.port),
                                             request.target, request.timeout.count()));
}

Result<ClientReply> FetchStreaming(const ClientRequest& request,
                                   std::chrono::milliseconds head_timeout,
                                   std::chrono::milliseconds idle,
                                   const std::function<bool(std::string_view)>& on_data) {
    static Client* shared = Client::Create(1).release();
    struct State {
        std::mutex mu;
        std::condition_variable cv;
        bool head = false;
        bool done = false;
        Status status;
        ClientReply reply;
        std::deque<std::string> pieces;
    };
    auto st = std::make_shared<State>();
    ClientRequest req = request;
    req.timeout = std::chrono::milliseconds(0);  // bounded here instead
    ClientCallbacks cb;
    cb.on_head = [st](const ClientHead& h) {
        std::lock_guard lock(st->mu);
        st->head = true;
        st->reply.status = h.status;
        st->reply.headers = h.headers;
        st->cv.notify_all();
    };
    cb.on_data = [st](std::string_view d) {
        std::lock_guard lock(st->mu);
        st->pieces.emplace_back(d);
        st->cv.notify_all();
    };
    cb.on_done = [st](const Status& s) {
        std::lock_guard lock(st->mu);
        st->done = true;
        st->status = s;
        st->cv.notify_all();
    };
    auto call = shared->Call(std::move(req), std::move(cb));
    const std::string where = FormatHostPort(request.host, request.port) + request.target;
    std::unique_lock lock(st->mu);
    if (!st->cv.wait_for(lock, head_timeout, [&] { return st->head || st->done; })) {
        lock.unlock();
        call->Cancel();
        return UnavailableError(
            fmt::format("{}: no answer within {} ms", where, head_timeout.count()));
    }
    for (;;) {
        while (!st->pieces.empty()) {
            std::string piece = std::move(st->pieces.front());
            st->pieces.pop_front();
            if (!on_data) {
                st->reply.body += piece;
                if (st->reply.body.size() > (64u << 20)) {
                    lock.unlock();
                    call->Cancel();
                    return UnavailableError(where + ": oversized reply");
                }
                continue;
            }
            lock.unlock();
            const bool more = on_data(piece);
            lock.lock();
            if (!more) {
                ClientReply r = std::move(st->reply);
                lock.unlock();
                call->Cancel();
                return r;
            }
        }
        if (st->done) {
            if (!st->status.ok() && !st->head) {
                return UnavailableError(fmt::format("{}: {}", where, st->status.message()));
            }
            // A stream cut after the head ends like a closed one: the caller has what came.
            return std::move(st->reply);
        }
        if (!st->cv.wait_for(lock, idle, [&] { return !st->pieces.empty() || st->done; })) {
            ClientReply r = std::move(st->reply);  // silence: the long poll's end
            lock.unlock();
            call->Cancel();
            return r;
        }
    }
}

namespace {

Result<Endpoint> ToEndpoint(Result<HostPort> hp) { return hp; }

}  // namespace

Result<Endpoint> ParseEndpoint(std::string_view url) {
    std::string_view s = url;
    if (s.substr(0, 7) == "http://") s.remove_prefix(7);
    const std::string_view authority = s.substr(0, s.find('/'));
    auto hp = ParseHostPort(authority, 1);
    if (!hp.ok()) return InvalidArgumentError(fmt::format("'{}': {}", url, hp.status().message()));
    return ToEndpoint(std::move(hp));
}

Result<Endpoint> ParseServerUrl(std::string_view url) {
    constexpr std::string_view kScheme = "http://";
    if (url.substr(0, kScheme.size()) != kScheme) {
        return InvalidArgumentError(fmt::format("'{}': only http://host[:port] is supported", url));
    }
    std::string_view rest = url.substr(kScheme.size());
    while (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
    if (rest.find('/') != std::string_view::npos) {
        return InvalidArgumentError(fmt::format("'{}': give the server's root, no path", url));
    }
    if (rest.empty()) return InvalidArgumentError(fmt::format("'{}': no host", url));
    // A port is given after the host: "host:port" or "[v6]:port"; "[v6]" or "host" alone is
    // port 80.
    const bool bracketed = rest.front() == '[';
    const size_t close = bracketed ? rest.find(']') : std::string_view::npos;
    const bool has_port = bracketed ? close != std::string_view::npos && close + 1 < rest.size()
                                    : rest.find(':') != std::string_view::npos;
    if (bracketed && close == rest.size() - 1) {
        return Endpoint{std::string(rest.substr(1, close - 1)), 80};
    }
    if (!has_port && !bracketed) return Endpoint{std::string(rest), 80};
    auto hp = ParseHostPort(rest, 1);
    if (!hp.ok()) return InvalidArgumentError(fmt::format("'{}': {}", url, hp.status().message()));
    return hp;
}

Result<Endpoint> ParseListenAddress(std::string_view address) {
    return ToEndpoint(ParseHostPort(address, 0));
}

}  // namespace ferry::http
