// TransferOp: the state of one posted READ, WRITE or pull, shared by the user's handle and the
// connections carrying its chunks.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ferry/agent.h"
#include "transfer/region_table.h"
#include "transfer/wire.h"

namespace ferry::internal {

class Connection;

class TransferOp {
  public:
    enum class Kind { kRead, kWrite, kPull };

    TransferOp(uint64_t id, Kind kind, uint64_t bytes, Clock::time_point deadline, std::string peer,
               wire::DataMode mode)
        : id_(id),
          kind_(kind),
          bytes_(bytes),
          deadline_(deadline),
          peer_(std::move(peer)),
          mode_(mode) {}

    uint64_t id() const { return id_; }
    Kind kind() const { return kind_; }
    uint64_t bytes() const { return bytes_; }
    Clock::time_point deadline() const { return deadline_; }
    const std::string& peer() const { return peer_; }
    wire::DataMode mode() const { return mode_; }

    // Before the first chunk is sent: how many chunks will report back, the local memory to keep
    // pinned until they have, and what to run on success before the op reports done (the tied
    // notification).
    void Arm(uint32_t chunks, std::vector<RegionPin> pins, std::function<void()> on_success);
    void AddConnection(const std::shared_ptr<Connection>& c);

    // A chunk finished (any thread). `value` is the pull's object size.
    void ChunkDone(const Status& s, uint64_t value = 0);
    // Ends the op with `s` (Cancelled, DeadlineExceeded, Unavailable...) unless already finished.
    // Afterwards no backend writes into its local memory (for cma chunks in flight, the
    // connections carrying them are closed so the peer stops).
    // `close_streams` = false leaves that to the caller (agent shutdown closes every stream after
    // marking every op, so that no op sees another's stream closure first).
    void Fail(const Status& s, bool close_streams = true);

    // One-sided shm: chunks this process copies itself, between its memory and its mapping of
    // the peer's region. `keep` holds those mappings until the op is destroyed. Set after Arm,
    // before the first RunLocalWork.
    struct LocalCopy {
        std::vector<iovec> local;
        std::vector<iovec> remote;
    };
    void SetLocalWork(std::vector<LocalCopy> work, bool to_remote,
                      std::vector<std::shared_ptr<void>> keep, uint64_t peer_epoch);
    // For backends that read and write the op's local memory on their own (ucx): Fail calls
    // `cut_off` while chunks are in flight and reports only once it has returned, i.e. once the
    // backend touches the memory no more. Pins are then held until every chunk has reported.
    // Set before Arm.
    void SetCutOff(std::function<void(const Status&)> cut_off);
    // Set for one-sided ops: the peer process they copy into. Its streams closing fails them.
    std::optional<uint64_t> one_sided_epoch() const;
    // Copies chunks until none is left or the op has ended (any thread: the I/O loops run it, and
    // Wait does, so a waiting caller never waits for a wake-up).
    // Copies one-sided chunks nobody has started yet, until none is left or `until` passes.
    void RunLocalWork(std::optional<Clock::time_point> until = std::nullopt);

    Result<TransferState> Poll() const;
    Status Wait(Clock::time_point deadline);
    // Runs `f` once the op reports (done or failed), at once if it has: on the reporting thread,
    // under the op's lock, so `f` must neither block nor touch the op.
    void SetOnReported(std::function<void()> f);
    bool finished() const;
    bool UsesLocalRegion(RegionId id) const;
    std::optional<uint64_t> pull_size() const;

    // Guards every access to the op's local memory by a backend: take io_mu, check io_closed.
    // Local copies run outside it, counted in local_active_: closing waits for them to end.
    std::mutex io_mu;
    bool io_closed = false;

  private:
    void FinishLocked(const Status& s);  // under mu_: final status, visible at once
    void ReportLocked();                 // under mu_: Poll and Wait see the status now
    // Sets io_closed and waits until no local copy runs.
    void CloseIo();

    // One-sided local work (SetLocalWork), claimed chunk by chunk under io_mu.
    std::vector<LocalCopy> work_;
    bool work_to_remote_ = false;
    std::vector<std::shared_ptr<void>> keep_;
    std::optional<uint64_t> one_sided_epoch_;  // under mu_
    size_t next_work_ = 0;                     // under io_mu
    uint32_t local_active_ = 0;                // under io_mu
    std::condition_variable io_cv_;

    const uint64_t id_;
    const Kind kind_;
    const uint64_t bytes_;
    const Clock::time_point deadline_;
    const std::string peer_;
    const wire::DataMode mode_;

    mutable std::mutex mu_;
    mutable std::condition_variable cv_;
    bool finished_ = false;  // the status is decided; no chunk changes it any more
    bool reported_ = false;  // Poll/Wait see it (after a cma cut-off has completed)
    std::atomic<bool> reported_flag_{false};  // reported_, readable without the lock
    Status status_;
    uint32_t chunks_left_ = 0;
    std::vector<RegionPin> pins_;
    std::vector<RegionId> local_regions_;
    std::function<void()> on_success_;
    std::function<void()> on_reported_;
    std::vector<std::weak_ptr<Connection>> conns_;
    std::optional<uint64_t> pull_size_;
    std::function<void(const Status&)> cut_off_;
};

}  // namespace ferry::internal
