#include "testing/faulty_backend.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <deque>
#include <set>
#include <thread>
#include <vector>

#include "transfer/transfer_op.h"

namespace ferry::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kPollMs = 5;

void SetNonBlocking(int fd) {
    int flags = fcntl(fd, F_GETFL, 0);
    fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

// One dialed connection: `agent` is the end the agent holds, `real` the wrapped backend's socket.
class Relay {
  public:
    Relay(ScopedFd agent, ScopedFd real, bool in_progress, std::shared_ptr<FaultPlan> plan,
          const std::atomic<bool>* stopping)
        : agent_(std::move(agent)),
          real_(std::move(real)),
          in_progress_(in_progress),
          plan_(std::move(plan)),
          stopping_(stopping),
          drops_(plan_->drops.load()) {}

    void Run() {
        plan_->connections.fetch_add(1);
        if (Connect()) Forward();
        plan_->connections.fetch_sub(1);
    }

  private:
    struct Pending {
        std::vector<char> bytes;
        size_t off = 0;
        bool empty() const { return off == bytes.size(); }
    };

    bool Cut() const {
        if (stopping_->load() || plan_->drops.load() != drops_) return true;
        int64_t limit = plan_->fail_after_bytes.load();
        return limit >= 0 && plan_->relayed.load() >= static_cast<uint64_t>(limit);
    }

    bool Connect() {
        if (!in_progress_) return true;
        for (;;) {
            if (Cut()) return false;
            pollfd p[2] = {{real_.get(), POLLOUT, 0}, {agent_.get(), 0, 0}};
            int n = poll(p, 2, kPollMs);
            if (n < 0 && errno != EINTR) return false;
            if (p[1].revents & (POLLHUP | POLLERR)) return false;
            if (p[0].revents != 0) {
                int err = 0;
                socklen_t len = sizeof(err);
                getsockopt(real_.get(), SOL_SOCKET, SO_ERROR, &err, &len);
                return err == 0;
            }
        }
    }

    // Reads what `from` has into `to` (empty before). false: that side closed or failed.
    bool Fill(int from, Pending* to, bool toward_initiator) {
        to->bytes.resize(64 * 1024);
        to->off = 0;
        ssize_t n = recv(from, to->bytes.data(), to->bytes.size(), 0);
        if (n == 0) return false;
        if (n < 0) {
            to->bytes.clear();
            return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
        }
        to->bytes.resize(static_cast<size_t>(n));
        int64_t limit = plan_->fail_after_bytes.load();
        if (limit >= 0) {
            uint64_t left = static_cast<uint64_t>(limit) -
                            std::min<uint64_t>(plan_->relayed.load(), static_cast<uint64_t>(limit));
            if (to->bytes.size() > left) to->bytes.resize(left);  // the rest never crosses
        }
        if (toward_initiator && !to->bytes.empty() && plan_->corrupt_next.exchange(false)) {
            to->bytes[0] = static_cast<char>(~to->bytes[0]);
        }
        plan_->relayed.fetch_add(to->bytes.size());
        if (int ms = plan_->delay_ms.load(); ms > 0) {
            std::this_thread::sleep_for(std::chrono::milliseconds(ms));
        }
        return true;
    }

    // Writes what it can of `p` to `fd`. false: that side failed.
    static bool Drain(int fd, Pending* p) {
        while (!p->empty()) {
            ssize_t n = send(fd, p->bytes.data() + p->off, p->bytes.size() - p->off, MSG_NOSIGNAL);
            if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
            p->off += static_cast<size_t>(n);
        }
        return true;
    }

    void Forward() {
        SetNonBlocking(agent_.get());
        SetNonBlocking(real_.get());
        Pending up, down;  // agent -> real (toward the target), real -> agent
        for (;;) {
            if (Cut()) return;
            const bool stalled = plan_->stall.load();
            pollfd p[2] = {{agent_.get(), 0, 0}, {real_.get(), 0, 0}};
            if (!stalled) {
                p[0].events = static_cast<short>(up.empty() ? POLLIN : 0) |
                              static_cast<short>(down.empty() ? 0 : POLLOUT);
                p[1].events = static_cast<short>(down.empty() ? POLLIN : 0) |
                              static_cast<short>(up.empty() ? 0 : POLLOUT);
            }
            int n = poll(p, 2, kPollMs);
            if (n < 0 && errno != EINTR) return;
            if (n <= 0) continue;
            if (stalled) {
                // Nothing moves; a side that goes away still ends the relay.
                if ((p[0].revents | p[1].revents) & (POLLHUP | POLLERR)) return;
                continue;
            }
            if ((p[0].revents & (POLLIN | POLLHUP | POLLERR)) && up.empty()) {
                if (!Fill(agent_.get(), &up, false)) return;
            }
            if ((p[1].revents & (POLLIN | POLLHUP | POLLERR)) && down.empty()) {
                if (!Fill(real_.get(), &down, true)) return;
            }
            if (!Drain(real_.get(), &up) || !Drain(agent_.get(), &down)) return;
        }
    }

    ScopedFd agent_;
    ScopedFd real_;
    const bool in_progress_;
    std::shared_ptr<FaultPlan> plan_;
    const std::atomic<bool>* stopping_;
    const uint64_t drops_;
};

class FaultyStreamBackend final : public Backend {
  public:
    FaultyStreamBackend(std::unique_ptr<Backend> inner, std::shared_ptr<FaultPlan> plan)
        : inner_(std::move(inner)), plan_(std::move(plan)) {}
    ~FaultyStreamBackend() override {
        stopping_ = true;
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& t : relays_) t.join();
    }

    std::string_view name() const override { return inner_->name(); }
    BackendCapabilities capabilities() const override { return inner_->capabilities(); }
    Result<std::string> Listen(ScopedFd* listener) override { return inner_->Listen(listener); }
    bool CanReach(const AgentMetadata& self, const AgentMetadata& peer) const override {
        return inner_->CanReach(self, peer);
    }
    wire::DataMode data_mode() const override { return inner_->data_mode(); }
    int streams() const override { return inner_->streams(); }
    void Configure(int fd) const override { inner_->Configure(fd); }
    bool verify_cma() const override { return inner_->verify_cma(); }

    Result<ScopedFd> Dial(std::string_view address, bool* in_progress) const override {
        bool real_in_progress = false;
        FERRY_ASSIGN_OR_RETURN(ScopedFd real, inner_->Dial(address, &real_in_progress));
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
            return UnavailableError("faulty backend: socketpair failed");
        }
        ScopedFd agent_end(sv[0]), relay_end(sv[1]);
        SetNonBlocking(agent_end.get());
        auto relay = std::make_shared<Relay>(std::move(relay_end), std::move(real),
                                             real_in_progress, plan_, &stopping_);
        {
            std::lock_guard<std::mutex> lock(mu_);
            relays_.emplace_back([relay] { relay->Run(); });
        }
        *in_progress = false;
        return agent_end;
    }

  private:
    std::unique_ptr<Backend> inner_;
    std::shared_ptr<FaultPlan> plan_;
    std::atomic<bool> stopping_{false};
    mutable std::mutex mu_;
    mutable std::vector<std::thread> relays_;
};

class FaultyOwnBackend final : public Backend {
  public:
    FaultyOwnBackend(std::unique_ptr<Backend> inner, std::shared_ptr<FaultPlan> plan)
        : inner_(std::move(inner)), plan_(std::move(plan)), drops_(plan_->drops.load()) {}
    ~FaultyOwnBackend() override { StopPump(); }

    std::string_view name() const override { return inner_->name(); }
    BackendCapabilities capabilities() const override { return inner_->capabilities(); }
    Result<std::string> Listen(ScopedFd* listener) override { return inner_->Listen(listener); }
    bool CanReach(const AgentMetadata& self, const AgentMetadata& peer) const override {
        return inner_->CanReach(self, peer);
    }
    Status Start(TargetServices* services) override {
        FERRY_RETURN_IF_ERROR(inner_->Start(services));
        pump_ = std::thread([this] { Pump(); });
        return Status::Ok();
    }
    void Stop() override {
        StopPump();
        FailHeld(CancelledError("faulty backend stopped"));
        inner_->Stop();
    }
    uint64_t chunk_bytes() const override { return inner_->chunk_bytes(); }
    uint32_t max_segments() const override { return inner_->max_segments(); }

    void Post(const std::shared_ptr<internal::TransferOp>& op, const PeerRef& peer, bool write,
              std::vector<Chunk> chunks, bool all_host) override {
        uint64_t bytes = 0;
        for (const Chunk& c : chunks) bytes += c.bytes;
        {
            std::lock_guard<std::mutex> lock(mu_);
            peers_.insert(peer.name);
        }
        int64_t limit = plan_->fail_after_bytes.load();
        if (limit >= 0 && plan_->relayed.load() + bytes > static_cast<uint64_t>(limit)) {
            Status s = UnavailableError("faulty backend: the link failed after " +
                                        std::to_string(limit) + " bytes");
            for (size_t i = 0; i < chunks.size(); ++i) op->ChunkDone(s);
            return;
        }
        plan_->relayed.fetch_add(bytes);
        Held h{op,       peer,
               write,    std::move(chunks),
               all_host, Clock::now() + std::chrono::milliseconds(plan_->delay_ms.load())};
        if (!plan_->stall.load() && plan_->delay_ms.load() == 0) {
            inner_->Post(h.op, h.peer, h.write, std::move(h.chunks), h.all_host);
            return;
        }
        std::lock_guard<std::mutex> lock(mu_);
        held_.push_back(std::move(h));
    }
    Status Notify(const PeerRef& peer, std::string payload, std::string sender) override {
        return inner_->Notify(peer, std::move(payload), std::move(sender));
    }
    void Pull(const std::shared_ptr<internal::TransferOp>& op, const PeerRef& peer, std::string key,
              std::vector<iovec> local, uint64_t capacity) override {
        inner_->Pull(op, peer, std::move(key), std::move(local), capacity);
    }
    void CutOff(uint64_t op_id, const Status& why) override {
        {
            // A held post never reaches the backend: its memory is untouched.
            std::lock_guard<std::mutex> lock(mu_);
            held_.erase(std::remove_if(held_.begin(), held_.end(),
                                       [&](const Held& h) { return h.op->id() == op_id; }),
                        held_.end());
        }
        inner_->CutOff(op_id, why);
    }
    void PeerLost(const std::string& peer, uint64_t epoch, const Status& why) override {
        inner_->PeerLost(peer, epoch, why);
    }
    void RevokeRegion(RegionId id, std::chrono::milliseconds grace) override {
        inner_->RevokeRegion(id, grace);
    }
    void RegionGone(RegionId id) override { inner_->RegionGone(id); }
    uint64_t one_sided_transfers() const override { return inner_->one_sided_transfers(); }

  private:
    struct Held {
        std::shared_ptr<internal::TransferOp> op;
        PeerRef peer;
        bool write = false;
        std::vector<Chunk> chunks;
        bool all_host = false;
        Clock::time_point due;
    };

    void StopPump() {
        stopping_ = true;
        if (pump_.joinable()) pump_.join();
    }

    void FailHeld(const Status& s) {
        std::deque<Held> held;
        {
            std::lock_guard<std::mutex> lock(mu_);
            held.swap(held_);
        }
        for (Held& h : held) {
            for (size_t i = 0; i < h.chunks.size(); ++i) h.op->ChunkDone(s);
        }
    }

    // Releases held posts when due and not stalled; a Drop fails what is held and in flight.
    void Pump() {
        while (!stopping_.load()) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
            if (uint64_t d = plan_->drops.load(); d != drops_) {
                drops_ = d;
                Status why = UnavailableError("faulty backend: connection dropped");
                std::set<std::string> peers;
                {
                    std::lock_guard<std::mutex> lock(mu_);
                    peers = peers_;
                }
                // Peers first: a post made once the held ones failed comes after the drop.
                for (const auto& p : peers) inner_->PeerLost(p, 0, why);
                FailHeld(why);
            }
            if (plan_->stall.load()) continue;
            std::vector<Held> ready;
            {
                std::lock_guard<std::mutex> lock(mu_);
                auto now = Clock::now();
                while (!held_.empty() && held_.front().due <= now) {
                    ready.push_back(std::move(held_.front()));
                    held_.pop_front();
                }
            }
            for (Held& h : ready) {
                inner_->Post(h.op, h.peer, h.write, std::move(h.chunks), h.all_host);
            }
        }
    }

    std::unique_ptr<Backend> inner_;
    std::shared_ptr<FaultPlan> plan_;
    uint64_t drops_;  // pump thread
    std::atomic<bool> stopping_{false};
    std::thread pump_;
    std::mutex mu_;
    std::deque<Held> held_;        // under mu_
    std::set<std::string> peers_;  // under mu_
};

}  // namespace

std::unique_ptr<Backend> MakeFaultyBackend(std::unique_ptr<Backend> inner,
                                           std::shared_ptr<FaultPlan> plan) {
    if (inner->capabilities().data_path == DataPath::kOwn) {
        return std::make_unique<FaultyOwnBackend>(std::move(inner), std::move(plan));
    }
    return std::make_unique<FaultyStreamBackend>(std::move(inner), std::move(plan));
}

}  // namespace ferry::testing
