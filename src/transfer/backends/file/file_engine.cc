#include "transfer/backends/file/file_engine.h"

#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <set>

#include "core/log.h"

#ifdef FERRY_HAVE_URING
#include <liburing.h>
#endif

namespace ferry::internal {

namespace {

// Larger ios are split, so that one big io does not hold the queue alone and cancellation has
// pieces to drop.
constexpr uint64_t kMaxPiece = 4u << 20;
constexpr uint64_t kWakeTag = 0;
constexpr uint64_t kCancelTag = ~0ull;

// FileStallGuard: how many live, and the engines to wake when the last one goes.
std::atomic<int> stall_guards{0};
std::mutex engines_mu;
std::set<FileEngine*>& Engines() {
    static auto* engines = new std::set<FileEngine*>;
    return *engines;
}

std::string Describe(const FileIo& io) {
    if (io.fd < 0) return "memory copy";
    return std::string(io.to_file ? "writing" : "reading") + " file region " +
           std::to_string(io.region) + " at file offset " + std::to_string(io.file_offset);
}

Status ErrnoStatus(int err, const FileIo& io, uint64_t done) {
    std::string what =
        Describe(io) + (done ? " (+" + std::to_string(done) + ")" : "") + ": " + std::strerror(err);
    if (err == EINVAL) {
        return InvalidArgumentError(what + " (with O_DIRECT: memory, offset and length must be " +
                                    std::to_string(kDirectAlignment) + "-byte aligned)");
    }
    if (err == ENOSPC || err == EDQUOT) return ResourceExhaustedError(what);
    if (err == EBADF) return FailedPreconditionError(what);
    return InternalError(what);
}

}  // namespace

// --- AlignedBuffer ----------------------------------------------------------------------------

std::shared_ptr<AlignedBuffer> AlignedBuffer::Allocate(size_t bytes) {
    size_t n = std::max<size_t>(
        kDirectAlignment, (bytes + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment);
    void* p =
        mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    return std::shared_ptr<AlignedBuffer>(new AlignedBuffer(static_cast<uint8_t*>(p), n));
}

AlignedBuffer::~AlignedBuffer() { munmap(data_, size_); }

// --- batches and slots ------------------------------------------------------------------------

class FileEngine::Batch {
  public:
    std::vector<FileIo> ios;
    std::function<void(const Status&)> done;
    size_t next = 0;         // the io to hand out next
    uint64_t next_done = 0;  // bytes of ios[next] already handed out
    uint32_t inflight = 0;
    bool ended = false;     // the status is decided; start nothing more
    bool finished = false;  // `done` is about to run or has run
    bool reported = false;  // `done` has returned
    Status status;
};

struct FileEngine::Slot {
    uint64_t tag = 0;  // user_data: index + 1
    bool in_use = false;
    bool cancel_sent = false;
    std::shared_ptr<Batch> batch;
    size_t io = 0;
    uint64_t offset = 0;  // within the io
    uint64_t length = 0;
};

#ifdef FERRY_HAVE_URING
struct FileEngine::Ring {
    io_uring ring{};
    uint64_t wake_buf = 0;
    ~Ring() { io_uring_queue_exit(&ring); }
};
#else
struct FileEngine::Ring {};
#endif

// --- engine -----------------------------------------------------------------------------------

FileStallGuard::FileStallGuard() { stall_guards.fetch_add(1); }

FileStallGuard::~FileStallGuard() {
    if (stall_guards.fetch_sub(1) != 1) return;
    std::lock_guard<std::mutex> lock(engines_mu);
    for (FileEngine* e : Engines()) e->Wake();
}

FileEngine::FileEngine(Options options) : options_(options) {
    std::lock_guard<std::mutex> lock(engines_mu);
    Engines().insert(this);
}

Result<std::unique_ptr<FileEngine>> FileEngine::Create(Options options) {
    options.queue_depth = std::clamp(options.queue_depth, 1u, 1024u);
    std::unique_ptr<FileEngine> e(new FileEngine(options));
    FERRY_RETURN_IF_ERROR(e->Start());
    return e;
}

Status FileEngine::Start() {
    for (unsigned i = 0; i < options_.queue_depth; ++i) {
        auto s = std::make_unique<Slot>();
        s->tag = i + 1;
        free_slots_.push_back(s.get());
        slots_.push_back(std::move(s));
    }
#ifdef FERRY_HAVE_URING
    if (options_.use_io_uring) {
        auto ring = std::make_unique<Ring>();
        // Room for every slot's io, a cancel for each, and the wake-up read.
        int rc = io_uring_queue_init(2 * options_.queue_depth + 2, &ring->ring, 0);
        if (rc == 0) {
            wake_fd_ = eventfd(0, EFD_CLOEXEC);
            if (wake_fd_ < 0) {
                return InternalError(std::string("file engine: eventfd: ") + std::strerror(errno));
            }
            ring_ = std::move(ring);
        } else {
            FERRY_LOG(kWarn,
                      "file backend: io_uring is not available ({}); falling back to "
                      "pread/pwrite on one thread",
                      std::strerror(-rc));
        }
    }
#endif
    thread_ = std::thread([this] { ring_ ? Loop() : LoopSync(); });
    return Status::Ok();
}

FileEngine::~FileEngine() {
    {
        std::lock_guard<std::mutex> lock(engines_mu);
        Engines().erase(this);
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
        for (auto& b : queue_) {
            if (!b->ended) {
                b->ended = true;
                b->status = CancelledError("the agent's file engine is shutting down");
            }
        }
        for (auto& s : slots_) {
            if (s->in_use && !s->batch->ended) {
                s->batch->ended = true;
                s->batch->status = CancelledError("the agent's file engine is shutting down");
            }
        }
        cancel_pending_ = true;
    }
    Wake();
    if (thread_.joinable()) thread_.join();
    if (wake_fd_ >= 0) close(wake_fd_);
}

std::string FileEngine::mode() const { return ring_ ? "io_uring" : "pread/pwrite"; }

void FileEngine::Wake() {
    if (ring_) {
        uint64_t one = 1;
        [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof one);
    } else {
        cv_.notify_all();
    }
}

std::shared_ptr<FileEngine::Batch> FileEngine::Submit(std::vector<FileIo> ios,
                                                      std::function<void(const Status&)> done) {
    auto b = std::make_shared<Batch>();
    b->ios = std::move(ios);
    b->done = std::move(done);
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) {
            b->ended = true;
            b->status = CancelledError("the agent's file engine is shutting down");
        }
        queue_.push_back(b);
    }
    Wake();
    return b;
}

void FileEngine::Cancel(const std::shared_ptr<Batch>& b, const Status& why) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!b->ended) {
        b->ended = true;
        b->status = why;
        if (b->inflight > 0) cancel_pending_ = true;
    }
    lock.unlock();
    Wake();
    lock.lock();
    cv_.wait(lock, [&] { return b->reported; });
}

Status FileEngine::Run(std::vector<FileIo> ios) {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    Status result;
    Submit(std::move(ios), [&](const Status& s) {
        std::lock_guard<std::mutex> lock(m);
        result = s;
        done = true;
        cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return done; });
    return result;
}

bool FileEngine::NextPiece(Slot* slot) {
    while (!queue_.empty()) {
        std::shared_ptr<Batch>& b = queue_.front();
        if (b->ended || b->next >= b->ios.size()) {
            if (!b->finished && b->inflight == 0) {
                return false;  // the scan in the loop finishes it first
            }
            queue_.pop_front();
            continue;
        }
        if (stall_guards.load() > 0) {
            return false;  // a test holds every io (FileStallGuard)
        }
        const FileIo& io = b->ios[b->next];
        uint64_t n = std::min(io.length - b->next_done, kMaxPiece);
        slot->batch = b;
        slot->io = b->next;
        slot->offset = b->next_done;
        slot->length = n;
        slot->in_use = true;
        slot->cancel_sent = false;
        ++b->inflight;
        b->next_done += n;
        if (b->next_done >= io.length) {
            ++b->next;
            b->next_done = 0;
        }
        return true;
    }
    return false;
}

void FileEngine::Finish(const std::shared_ptr<Batch>& b,
                        std::vector<std::shared_ptr<Batch>>* finished) {
    if (b->finished) return;
    b->finished = true;
    b->ended = true;
    finished->push_back(b);
}

void FileEngine::Complete(Slot* slot, int64_t res, std::vector<std::shared_ptr<Batch>>* finished) {
    std::shared_ptr<Batch> b = std::move(slot->batch);
    const FileIo& io = b->ios[slot->io];
    slot->in_use = false;
    --b->inflight;
    if (res < 0 && !b->ended) {
        int err = static_cast<int>(-res);
        b->ended = true;
        b->status = err == ECANCELED ? CancelledError(Describe(io) + ": cancelled")
                                     : ErrnoStatus(err, io, slot->offset);
    } else if (res == 0 && slot->length > 0 && !b->ended) {
        b->ended = true;
        b->status = io.to_file ? InternalError(Describe(io) + ": the file took no bytes")
                               : OutOfRangeError(Describe(io) + ": the file ends at offset " +
                                                 std::to_string(io.file_offset + slot->offset));
    }
    if (b->inflight == 0 && (b->ended || b->next >= b->ios.size())) {
        Finish(b, finished);
    }
    free_slots_.push_back(slot);
}

// io_uring: one thread submits and reaps; a read on the wake eventfd stays queued in the ring so
// that Submit and Cancel wake it from io_uring_submit_and_wait.
void FileEngine::Loop() {
#ifdef FERRY_HAVE_URING
    io_uring* ring = &ring_->ring;
    bool wake_armed = false;
    std::vector<std::shared_ptr<Batch>> finished;
    std::vector<Slot*> copies;
    auto get_sqe = [&]() {
        io_uring_sqe* sqe = io_uring_get_sqe(ring);
        if (sqe == nullptr) {
            io_uring_submit(ring);
            sqe = io_uring_get_sqe(ring);
        }
        return sqe;
    };
    auto prep = [&](Slot* s) {
        const FileIo& io = s->batch->ios[s->io];
        io_uring_sqe* sqe = get_sqe();
        uint8_t* mem = io.mem + s->offset;
        unsigned len = static_cast<unsigned>(s->length);
        if (io.to_file) {
            io_uring_prep_write(sqe, io.fd, mem, len, io.file_offset + s->offset);
        } else {
            io_uring_prep_read(sqe, io.fd, mem, len, io.file_offset + s->offset);
        }
        io_uring_sqe_set_data64(sqe, s->tag);
    };
    for (;;) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            // Batches that ended before (or without) starting every io.
            for (auto& b : queue_) {
                if ((b->ended || b->next >= b->ios.size()) && b->inflight == 0)
                    Finish(b, &finished);
            }
            if (cancel_pending_) {
                cancel_pending_ = false;
                for (auto& s : slots_) {
                    if (s->in_use && s->batch->ended && !s->cancel_sent) {
                        s->cancel_sent = true;
                        io_uring_sqe* sqe = get_sqe();
                        io_uring_prep_cancel64(sqe, s->tag, 0);
                        io_uring_sqe_set_data64(sqe, kCancelTag);
                    }
                }
            }
            while (!free_slots_.empty()) {
                Slot* s = free_slots_.back();
                if (!NextPiece(s)) break;
                free_slots_.pop_back();
                if (s->batch->ios[s->io].fd < 0) {
                    copies.push_back(s);
                } else {
                    prep(s);
                }
            }
        }
        if (!copies.empty()) {
            for (Slot* s : copies) {
                const FileIo& io = s->batch->ios[s->io];
                std::memcpy(io.mem + s->offset, io.from + s->offset, s->length);
            }
            std::lock_guard<std::mutex> lock(mu_);
            for (Slot* s : copies) Complete(s, static_cast<int64_t>(s->length), &finished);
            copies.clear();
        }
        if (!finished.empty()) {
            for (auto& b : finished) b->done(b->status);
            std::lock_guard<std::mutex> lock(mu_);
            for (auto& b : finished) {
                b->reported = true;
                b->done = nullptr;
            }
            finished.clear();
            cv_.notify_all();
            continue;  // their ends may have freed more work
        }
        {
            std::lock_guard<std::mutex> lock(mu_);
            bool busy = free_slots_.size() < slots_.size();
            if (stop_ && !busy && queue_.empty()) break;
        }
        if (!wake_armed) {
            io_uring_sqe* sqe = get_sqe();
            io_uring_prep_read(sqe, wake_fd_, &ring_->wake_buf, sizeof ring_->wake_buf, 0);
            io_uring_sqe_set_data64(sqe, kWakeTag);
            wake_armed = true;
        }
        int rc = io_uring_submit_and_wait(ring, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
            FERRY_LOG(kError, "file backend: io_uring_submit_and_wait: {}", std::strerror(-rc));
        }
        std::lock_guard<std::mutex> lock(mu_);
        io_uring_cqe* cqe = nullptr;
        unsigned head = 0, seen = 0;
        io_uring_for_each_cqe(ring, head, cqe) {
            ++seen;
            uint64_t tag = io_uring_cqe_get_data64(cqe);
            if (tag == kWakeTag) {
                wake_armed = false;
                continue;
            }
            if (tag == kCancelTag) continue;
            Slot* s = slots_[tag - 1].get();
            int64_t res = cqe->res;
            if ((res == -EAGAIN || res == -EINTR) && !s->batch->ended) {
                prep(s);  // try again
                continue;
            }
            if (res > 0 && static_cast<uint64_t>(res) < s->length && !s->batch->ended) {
                s->offset += static_cast<uint64_t>(res);  // short: continue where it stopped
                s->length -= static_cast<uint64_t>(res);
                prep(s);
                continue;
            }
            Complete(s, res, &finished);
        }
        io_uring_cq_advance(ring, seen);
    }
#endif
}

// Without io_uring: one piece at a time on this thread.
void FileEngine::LoopSync() {
    std::vector<std::shared_ptr<Batch>> finished;
    Slot* s = slots_[0].get();
    for (;;) {
        std::unique_lock<std::mutex> lock(mu_);
        for (auto& b : queue_) {
            if ((b->ended || b->next >= b->ios.size()) && b->inflight == 0) Finish(b, &finished);
        }
        if (finished.empty()) {
            if (free_slots_.empty() || !NextPiece(s)) {
                if (stop_ && queue_.empty()) return;
                cv_.wait(lock);
                continue;
            }
            free_slots_.erase(std::find(free_slots_.begin(), free_slots_.end(), s));
            lock.unlock();
            const FileIo& io = s->batch->ios[s->io];
            int64_t res = static_cast<int64_t>(s->length);
            uint64_t done = 0;
            while (done < s->length) {
                uint8_t* mem = io.mem + s->offset + done;
                uint64_t off = io.file_offset + s->offset + done;
                size_t n = s->length - done;
                ssize_t r = static_cast<ssize_t>(n);
                if (io.fd < 0) {
                    std::memcpy(mem, io.from + s->offset + done, n);
                } else if (io.to_file) {
                    r = pwrite(io.fd, mem, n, static_cast<off_t>(off));
                } else {
                    r = pread(io.fd, mem, n, static_cast<off_t>(off));
                }
                if (r < 0 && errno == EINTR) continue;
                if (r <= 0) {
                    res = r < 0 ? -errno : 0;
                    s->offset += done;
                    s->length -= done;
                    break;
                }
                done += static_cast<uint64_t>(r);
            }
            lock.lock();
            Complete(s, res, &finished);
        }
        lock.unlock();
        for (auto& b : finished) b->done(b->status);
        lock.lock();
        for (auto& b : finished) {
            b->reported = true;
            b->done = nullptr;
        }
        finished.clear();
        cv_.notify_all();
    }
}

}  // namespace ferry::internal
