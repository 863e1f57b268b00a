// FileEngine: the file backend's I/O engine. Moves bytes between memory and files (and, for
// transfers between an agent's own memory regions, between two buffers) in batches, through
// io_uring when the kernel allows it and through pread/pwrite on the engine's thread when it does
// not (io_uring refused by a seccomp profile, or a build without liburing).
//
// One engine per agent, created with its first file region; one thread owns the ring. A batch's
// ios are queued in order and kept `queue_depth` deep in the kernel; short reads and writes are
// continued, and the batch ends with the first error.
#pragma once

#include <sys/uio.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ferry/status.h"

namespace ferry::internal {

// One piece of a batch: `length` bytes between `mem` and the file `fd` at `file_offset`, or, with
// fd == -1, a memory copy from `from` to `mem`.
struct FileIo {
    int fd = -1;
    uint64_t file_offset = 0;
    uint8_t* mem = nullptr;
    uint64_t length = 0;
    bool to_file = false;  // memory -> file (a write); false: file -> memory (a read)
    const uint8_t* from = nullptr;
    // For errors: which region and file this piece belongs to.
    uint64_t region = 0;
};

// Memory aligned for O_DIRECT (4096), pre-faulted. Owned by whoever holds the shared_ptr.
class AlignedBuffer {
  public:
    static std::shared_ptr<AlignedBuffer> Allocate(size_t bytes);
    ~AlignedBuffer();
    uint8_t* data() const { return data_; }
    size_t size() const { return size_; }

  private:
    AlignedBuffer(uint8_t* data, size_t size) : data_(data), size_(size) {}
    uint8_t* data_;
    size_t size_;
};

// Bytes of a file region that a peer's request touches, staged through memory: `ios` move them
// between the file and `buffer` (to_file as the direction needs; set by the caller).
struct FileStaging {
    std::shared_ptr<AlignedBuffer> buffer;
    std::vector<FileIo> ios;
    bool empty() const { return ios.empty(); }
};

inline constexpr uint64_t kDirectAlignment = 4096;

// For tests (tests/conformance/file_backend_test.cc): while a guard lives, no file engine starts
// an io (its queued ios wait, as behind a stalled disk), so that a cancel, a deadline, a
// Deregister or a shutdown meets a batch that certainly has not finished. Ios already in the
// kernel go on. When the last guard goes, every engine resumes.
class FileStallGuard {
  public:
    FileStallGuard();
    ~FileStallGuard();
    FileStallGuard(const FileStallGuard&) = delete;
    FileStallGuard& operator=(const FileStallGuard&) = delete;
};

class FileEngine {
  public:
    struct Options {
        unsigned queue_depth = 64;
        bool use_io_uring = true;  // false: pread/pwrite on the engine thread
    };
    class Batch;

    static Result<std::unique_ptr<FileEngine>> Create(Options options);
    // Ends every batch (Cancelled) and waits until the kernel touches none of their memory.
    ~FileEngine();
    FileEngine(const FileEngine&) = delete;
    FileEngine& operator=(const FileEngine&) = delete;

    // Starts `ios`. `done` runs exactly once, on the engine thread, when every io has completed
    // (or the first one failed and the others have stopped), with the batch's status. It must not
    // call Cancel or Run.
    std::shared_ptr<Batch> Submit(std::vector<FileIo> ios, std::function<void(const Status&)> done);
    // Ends `batch` with `why` unless it has ended: ios not started yet are dropped, those in the
    // kernel are cancelled. Returns after `done` has run, i.e. once no memory of the batch is
    // touched any more. Not from the engine thread.
    void Cancel(const std::shared_ptr<Batch>& batch, const Status& why);
    // Submit and wait.
    Status Run(std::vector<FileIo> ios);

    // "io_uring" or "pread/pwrite".
    std::string mode() const;

  private:
    friend class FileStallGuard;  // wakes every engine when the stall ends
    struct Slot;
    explicit FileEngine(Options options);
    Status Start();
    void Loop();
    void LoopSync();
    // Under mu_: the next piece of queued work, or false.
    bool NextPiece(Slot* slot);
    // Under mu_: `slot` is done with `res` (bytes moved, or -errno).
    void Complete(Slot* slot, int64_t res, std::vector<std::shared_ptr<Batch>>* finished);
    void Finish(const std::shared_ptr<Batch>& b, std::vector<std::shared_ptr<Batch>>* finished);
    void Wake();

    const Options options_;
    struct Ring;
    std::unique_ptr<Ring> ring_;  // null: synchronous mode
    int wake_fd_ = -1;

    std::mutex mu_;
    std::condition_variable cv_;                // a batch ended; or new work (synchronous mode)
    std::deque<std::shared_ptr<Batch>> queue_;  // batches with ios not yet started
    std::vector<std::unique_ptr<Slot>> slots_;
    std::vector<Slot*> free_slots_;
    bool stop_ = false;
    bool cancel_pending_ = false;  // a Cancel wants in-flight ios cancelled
    std::thread thread_;
};

}  // namespace ferry::internal
