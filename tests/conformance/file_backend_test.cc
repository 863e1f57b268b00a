// The file backend: file regions registered like memory, moved to and from memory by a transfer
// to the agent itself (io_uring, or pread/pwrite), and READ or WRITTEN by peers over every
// network backend (the target stages the file's bytes through memory).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "testing/testing.h"
#include "transfer/backends/file/file_engine.h"

namespace ferry {
namespace {

using ::ferry::testing::FillPattern;
using ::ferry::testing::FirstMismatch;
using ::ferry::testing::MakePair;
using ::ferry::testing::StatusHas;
using ::ferry::testing::StatusIs;
using ::ferry::testing::ValueOrDie;
using std::chrono::seconds;

// A fresh directory in the working directory (the build tree: a real disk, where O_DIRECT works;
// /tmp may be tmpfs), removed afterwards.
class TempDir {
  public:
    TempDir() {
        std::string tmpl = (std::filesystem::current_path() / "ferry-file-test-XXXXXX").string();
        char* p = mkdtemp(tmpl.data());
        if (p == nullptr) std::abort();
        path_ = p;
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path_, ec);
    }
    std::string File(const std::string& name) const { return path_ + "/" + name; }

  private:
    std::string path_;
};

std::vector<uint8_t> ReadFile(const std::string& path, uint64_t offset, uint64_t length) {
    std::vector<uint8_t> out(length);
    ScopedFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
    EXPECT_TRUE(fd.valid()) << path;
    uint64_t done = 0;
    while (done < length) {
        ssize_t n = pread(fd.get(), out.data() + done, length - done, offset + done);
        if (n <= 0) break;
        done += static_cast<uint64_t>(n);
    }
    out.resize(done);
    return out;
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
    ScopedFd fd(open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    ASSERT_TRUE(fd.valid()) << path;
    ASSERT_EQ(write(fd.get(), bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
}

bool DirectIoWorks(const std::string& dir_file) {
    ScopedFd fd(open(dir_file.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0644));
    unlink(dir_file.c_str());
    return fd.valid();
}

// --- transfers between an agent's memory and its own file regions -----------------------------

// Parameter: AgentConfig.file_io ("io_uring", "pread").
class LocalFileTransfers : public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        AgentConfig c;
        c.name = "filer";
        c.file_io = GetParam();
        agent_ = ValueOrDie(Agent::Create(c));
    }
    Status Run(bool read, const std::vector<Descriptor>& mem, const std::vector<Descriptor>& file,
               TransferOptions opts = {}) {
        auto x = read ? agent_->PostRead(mem, agent_->name(), file, opts)
                      : agent_->PostWrite(mem, agent_->name(), file, opts);
        if (!x.ok()) return x.status();
        return x->Wait(seconds(60));
    }
    TempDir dir_;
    std::unique_ptr<Agent> agent_;
};

TEST_P(LocalFileTransfers, WriteThenReadBackEverySize) {
    const uint64_t kRegion = 64u << 20;
    RegionInfo mem = ValueOrDie(agent_->AllocateRegion(kRegion));
    const std::string path = dir_.File("kv.bin");
    RegionInfo file = ValueOrDie(agent_->RegisterFile(path, 4096, kRegion, {.create = true}));
    EXPECT_EQ(file.kind, MemoryKind::kFile);
    EXPECT_EQ(file.base, nullptr);
    EXPECT_GE(std::filesystem::file_size(path), 4096 + kRegion);
    uint64_t seed = 10;
    for (uint64_t size : {uint64_t{1}, uint64_t{7}, uint64_t{4096}, uint64_t{65537},
                          uint64_t{(1u << 20) + 3}, kRegion}) {
        SCOPED_TRACE("size " + std::to_string(size));
        const uint64_t at = size == kRegion ? 0 : 333;  // an unaligned file offset
        FillPattern(mem.base, size, ++seed);
        FERRY_ASSERT_OK(Run(false, {{mem.id, 0, size}}, {{file.id, at, size}}));
        // The bytes are in the file, at the region's offset in it.
        std::vector<uint8_t> on_disk = ReadFile(path, 4096 + at, size);
        ASSERT_EQ(on_disk.size(), size);
        EXPECT_EQ(FirstMismatch(on_disk.data(), size, seed), -1);
        std::memset(mem.base, 0, size);
        FERRY_ASSERT_OK(Run(true, {{mem.id, 0, size}}, {{file.id, at, size}}));
        EXPECT_EQ(FirstMismatch(mem.base, size, seed), -1);
    }
}

TEST_P(LocalFileTransfers, GatherScatterStridedAndMixedWithMemory) {
    const uint64_t block = 16384, n = 64;
    RegionInfo mem = ValueOrDie(agent_->AllocateRegion(2 * n * block));
    RegionInfo other = ValueOrDie(agent_->AllocateRegion(n * block));
    RegionInfo file =
        ValueOrDie(agent_->RegisterFile(dir_.File("blocks.bin"), 0, n * block, {.create = true}));
    // Memory blocks 0, 2, 4, ... -> file blocks in reverse order (one batch, 64 descriptors).
    std::vector<Descriptor> local, remote;
    for (uint64_t i = 0; i < n; ++i) {
        FillPattern(static_cast<uint8_t*>(mem.base) + 2 * i * block, block, 500 + i);
        local.push_back({mem.id, 2 * i * block, block});
        remote.push_back({file.id, (n - 1 - i) * block, block});
    }
    FERRY_ASSERT_OK(Run(false, local, remote));
    std::vector<uint8_t> disk = ReadFile(dir_.File("blocks.bin"), 0, n * block);
    for (uint64_t i = 0; i < n; ++i) {
        ASSERT_EQ(FirstMismatch(disk.data() + (n - 1 - i) * block, block, 500 + i), -1) << i;
    }
    // A strided descriptor: the first 4 KiB of every file block, gathered into one memory run.
    std::memset(other.base, 0, n * block);
    FERRY_ASSERT_OK(
        Run(true, {{other.id, 0, n * 4096}}, {{file.id, 0, 4096, /*stride=*/block, /*count=*/n}}));
    for (uint64_t i = 0; i < n; ++i) {
        std::vector<uint8_t> expect(block);
        FillPattern(expect.data(), block, 500 + (n - 1 - i));
        ASSERT_EQ(std::memcmp(static_cast<uint8_t*>(other.base) + i * 4096, expect.data(), 4096), 0)
            << i;
    }
    // Memory to memory within the agent is a plain copy.
    FillPattern(mem.base, block, 9);
    FERRY_ASSERT_OK(Run(false, {{mem.id, 0, block}}, {{other.id, block, block}}));
    EXPECT_EQ(FirstMismatch(static_cast<uint8_t*>(other.base) + block, block, 9), -1);
}

TEST_P(LocalFileTransfers, RandomSmallReadsInOneBatch) {
    const uint64_t block = 16384, blocks = 1024;
    std::vector<uint8_t> content(block * blocks);
    FillPattern(content.data(), content.size(), 42);
    WriteFile(dir_.File("pool.bin"), content);
    RegionInfo file = ValueOrDie(
        agent_->RegisterFile(dir_.File("pool.bin"), 0, content.size(), {.read_only = true}));
    RegionInfo mem = ValueOrDie(agent_->AllocateRegion(256 * block));
    std::mt19937_64 rng(7);
    std::vector<Descriptor> local, remote;
    std::vector<uint64_t> picked;
    for (uint64_t i = 0; i < 256; ++i) {
        uint64_t b = rng() % blocks;
        picked.push_back(b);
        local.push_back({mem.id, i * block, block});
        remote.push_back({file.id, b * block, block});
    }
    FERRY_ASSERT_OK(Run(true, local, remote));
    for (uint64_t i = 0; i < 256; ++i) {
        ASSERT_EQ(std::memcmp(static_cast<uint8_t*>(mem.base) + i * block,
                              content.data() + picked[i] * block, block),
                  0)
            << "descriptor " << i;
    }
}

TEST_P(LocalFileTransfers, BadTransfersAreRefusedWithTheirReason) {
    RegionInfo mem = ValueOrDie(agent_->AllocateRegion(1 << 20));
    RegionInfo file =
        ValueOrDie(agent_->RegisterFile(dir_.File("a.bin"), 0, 1 << 20, {.create = true}));
    RegionInfo file2 =
        ValueOrDie(agent_->RegisterFile(dir_.File("b.bin"), 0, 1 << 20, {.create = true}));
    std::vector<uint8_t> ro(4096, 1);
    WriteFile(dir_.File("ro.bin"), ro);
    RegionInfo readonly =
        ValueOrDie(agent_->RegisterFile(dir_.File("ro.bin"), 0, 4096, {.read_only = true}));
    EXPECT_THAT(Run(false, {{mem.id, 0, 4096}}, {{file.id, (1 << 20) - 100, 4096}}),
                StatusIs(Code::kOutOfRange));
    EXPECT_THAT(Run(false, {{mem.id, 0, 4096}}, {{999, 0, 4096}}), StatusIs(Code::kNotFound));
    EXPECT_THAT(Run(false, {{mem.id, 0, 4096}}, {{file.id, 0, 4095}}),
                StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(Run(false, {{file2.id, 0, 4096}}, {{file.id, 0, 4096}}),
                StatusHas(Code::kInvalidArgument, "file to file"));
    EXPECT_THAT(Run(false, {{mem.id, 0, 4096}}, {{readonly.id, 0, 4096}}),
                StatusHas(Code::kPermissionDenied, "read-only"));
    FERRY_EXPECT_OK(Run(true, {{mem.id, 0, 4096}}, {{readonly.id, 0, 4096}}));
    EXPECT_THAT(Run(false, {{mem.id, 0, 4096}}, {{file.id, 0, 4096}}, {.notification = "x"}),
                StatusHas(Code::kInvalidArgument, "no notification"));
    EXPECT_THAT(Run(false, {{mem.id, 0, 4096}}, {{file.id, 0, 4096}}, {.backend = "tcp"}),
                StatusHas(Code::kInvalidArgument, "file backend"));
    // A file region cannot be published as a named object.
    EXPECT_THAT(agent_->Publish("k", {{file.id, 0, 10}}),
                StatusHas(Code::kInvalidArgument, "file"));
    // The agent keeps working.
    FillPattern(mem.base, 4096, 3);
    FERRY_ASSERT_OK(Run(false, {{mem.id, 0, 4096}}, {{file.id, 0, 4096}}));
    EXPECT_EQ(FirstMismatch(ReadFile(dir_.File("a.bin"), 0, 4096).data(), 4096, 3), -1);
}

TEST_P(LocalFileTransfers, AFileThatShrankFailsTheReadWithOutOfRange) {
    RegionInfo mem = ValueOrDie(agent_->AllocateRegion(1 << 20));
    RegionInfo file =
        ValueOrDie(agent_->RegisterFile(dir_.File("s.bin"), 0, 1 << 20, {.create = true}));
    ASSERT_EQ(truncate(dir_.File("s.bin").c_str(), 1000), 0);  // someone else truncates it
    EXPECT_THAT(Run(true, {{mem.id, 0, 1 << 20}}, {{file.id, 0, 1 << 20}}),
                StatusHas(Code::kOutOfRange, "ends at offset 1000"));
}

TEST_P(LocalFileTransfers, DirectIoNeedsAlignmentAndSaysSo) {
    if (!DirectIoWorks(dir_.File("probe"))) GTEST_SKIP() << "no O_DIRECT on this file system";
    const uint64_t kBytes = 8u << 20;
    RegionInfo mem = ValueOrDie(agent_->AllocateRegion(kBytes + 4096));  // page aligned
    EXPECT_THAT(
        agent_->RegisterFile(dir_.File("d.bin"), 100, kBytes, {.create = true, .direct = true}),
        StatusHas(Code::kInvalidArgument, "multiples of 4096"));
    RegionInfo file = ValueOrDie(
        agent_->RegisterFile(dir_.File("d.bin"), 0, kBytes, {.create = true, .direct = true}));
    FillPattern(mem.base, kBytes, 77);
    FERRY_ASSERT_OK(Run(false, {{mem.id, 0, kBytes}}, {{file.id, 0, kBytes}}));
    EXPECT_EQ(FirstMismatch(ReadFile(dir_.File("d.bin"), 0, kBytes).data(), kBytes, 77), -1);
    std::memset(mem.base, 0, kBytes);
    FERRY_ASSERT_OK(Run(true, {{mem.id, 0, kBytes}}, {{file.id, 0, kBytes}}));
    EXPECT_EQ(FirstMismatch(mem.base, kBytes, 77), -1);
    // Misaligned memory, file offset or length: refused when posted, naming the alignment.
    EXPECT_THAT(Run(true, {{mem.id, 1, 4096}}, {{file.id, 0, 4096}}),
                StatusHas(Code::kInvalidArgument, "aligned to 4096"));
    EXPECT_THAT(Run(true, {{mem.id, 0, 4096}}, {{file.id, 512, 4096}}),
                StatusHas(Code::kInvalidArgument, "O_DIRECT"));
    EXPECT_THAT(Run(true, {{mem.id, 0, 1000}}, {{file.id, 0, 1000}}),
                StatusHas(Code::kInvalidArgument, "O_DIRECT"));
}

TEST_P(LocalFileTransfers, RegistrationErrorsNameTheFileAndTheProblem) {
    EXPECT_THAT(agent_->RegisterFile(dir_.File("missing"), 0, 10),
                StatusHas(Code::kNotFound, "missing"));
    EXPECT_THAT(agent_->RegisterFile(dir_.File(""), 0, 10),
                StatusHas(Code::kInvalidArgument, "directory"));
    EXPECT_THAT(agent_->RegisterFile(dir_.File(""), 0, 10, {.read_only = true}),
                StatusHas(Code::kInvalidArgument, "not a regular file"));
    std::vector<uint8_t> small(100, 1);
    WriteFile(dir_.File("small"), small);
    EXPECT_THAT(agent_->RegisterFile(dir_.File("small"), 50, 100),
                StatusHas(Code::kInvalidArgument, "beyond the end of the file (100 bytes)"));
    EXPECT_THAT(agent_->RegisterFile(dir_.File("small"), 0, 0),
                StatusHas(Code::kInvalidArgument, "zero length"));
    EXPECT_THAT(
        agent_->RegisterFile(dir_.File("small"), 0, 10, {.create = true, .read_only = true}),
        StatusIs(Code::kInvalidArgument));
    // create extends a short file without touching what it holds.
    RegionInfo grown =
        ValueOrDie(agent_->RegisterFile(dir_.File("small"), 50, 100, {.create = true}));
    EXPECT_EQ(std::filesystem::file_size(dir_.File("small")), 150u);
    EXPECT_EQ(ReadFile(dir_.File("small"), 0, 100), small);
    FERRY_EXPECT_OK(agent_->Deregister(grown.id));
    // By descriptor: the agent keeps its own duplicate; the flags must match the options.
    ScopedFd ro(open(dir_.File("small").c_str(), O_RDONLY | O_CLOEXEC));
    EXPECT_THAT(agent_->RegisterFileDescriptor(ro.get(), 0, 100),
                StatusHas(Code::kInvalidArgument, "read-only"));
    EXPECT_THAT(agent_->RegisterFileDescriptor(-1, 0, 100), StatusIs(Code::kInvalidArgument));
    RegionInfo by_fd =
        ValueOrDie(agent_->RegisterFileDescriptor(ro.get(), 0, 100, {.read_only = true}));
    ro.Reset();  // closing ours does not affect the region
    RegionInfo mem = ValueOrDie(agent_->AllocateRegion(4096));
    FERRY_ASSERT_OK(Run(true, {{mem.id, 0, 100}}, {{by_fd.id, 0, 100}}));
    EXPECT_EQ(std::memcmp(mem.base, small.data(), 100), 0);
}

TEST_P(LocalFileTransfers, CancelDeregisterAndShutdownStopBatchesCleanly) {
    const uint64_t kBytes = 256u << 20;
    RegionInfo mem = ValueOrDie(agent_->AllocateRegion(kBytes));
    RegionInfo file =
        ValueOrDie(agent_->RegisterFile(dir_.File("big.bin"), 0, kBytes, {.create = true}));
    std::vector<Descriptor> local, remote;
    for (uint64_t off = 0; off < kBytes; off += 1u << 20) {  // 256 ios of 1 MiB
        local.push_back({mem.id, off, 1u << 20});
        remote.push_back({file.id, kBytes - (1u << 20) - off, 1u << 20});
    }
    // Cancel: returns once the kernel is done with the memory; the status says Cancelled unless
    // the whole batch finished first. (Here the ios are really in the kernel, so each ending may
    // lose the race; OnAStalledDisk... below holds them so that each ending must win.)
    Transfer t = ValueOrDie(agent_->PostWrite(local, agent_->name(), remote));
    (void)t.Cancel();
    Status w = t.Wait(seconds(30));
    EXPECT_TRUE(w.ok() || w.code() == Code::kCancelled) << w.ToString();
    // Deregistering the file region fails the transfer using it, then returns.
    Transfer u = ValueOrDie(agent_->PostRead(local, agent_->name(), remote));
    FERRY_ASSERT_OK(agent_->Deregister(file.id));
    Status uw = u.Wait(seconds(30));
    EXPECT_TRUE(uw.ok() || uw.code() == Code::kCancelled) << uw.ToString();
    EXPECT_THAT(Run(true, {{mem.id, 0, 4096}}, {{file.id, 0, 4096}}), StatusIs(Code::kNotFound));
    // A deadline.
    RegionInfo again =
        ValueOrDie(agent_->RegisterFile(dir_.File("big.bin"), 0, kBytes, {.create = true}));
    for (auto& d : remote) d.region = again.id;
    Transfer v = ValueOrDie(agent_->PostWrite(local, agent_->name(), remote,
                                              {.timeout = std::chrono::milliseconds(1)}));
    Status vw = v.Wait(seconds(30));
    EXPECT_TRUE(vw.ok() || vw.code() == Code::kDeadlineExceeded) << vw.ToString();
    // Destroying the agent with a batch in flight.
    Transfer x = ValueOrDie(agent_->PostWrite(local, agent_->name(), remote));
    agent_.reset();
    Status xw = x.Wait(seconds(30));
    EXPECT_TRUE(xw.ok() || xw.code() == Code::kCancelled) << xw.ToString();
}

// The same on a stalled disk (internal::FileStallGuard: no io starts), where each ending must win:
// the batch cannot have finished first. After the stall the engine works as before.
TEST_P(LocalFileTransfers, OnAStalledDiskCancelDeadlineDeregisterAndShutdownEndTheBatch) {
    const uint64_t kBytes = 8u << 20;
    RegionInfo mem = ValueOrDie(agent_->AllocateRegion(kBytes));
    RegionInfo file =
        ValueOrDie(agent_->RegisterFile(dir_.File("stall.bin"), 0, kBytes, {.create = true}));
    const std::vector<Descriptor> local = {{mem.id, 0, kBytes}};
    std::vector<Descriptor> remote = {{file.id, 0, kBytes}};
    FillPattern(mem.base, kBytes, 7);
    {
        internal::FileStallGuard stall;
        Transfer t = ValueOrDie(agent_->PostWrite(local, agent_->name(), remote));
        EXPECT_THAT(t.Wait(std::chrono::milliseconds(50)), StatusIs(Code::kDeadlineExceeded));
        EXPECT_EQ(ValueOrDie(t.Poll()), TransferState::kPending)
            << "nothing moves while the disk is stalled";
        FERRY_EXPECT_OK(t.Cancel());
        EXPECT_THAT(t.Wait(seconds(30)), StatusIs(Code::kCancelled));

        Transfer d = ValueOrDie(agent_->PostWrite(local, agent_->name(), remote,
                                                  {.timeout = std::chrono::milliseconds(100)}));
        EXPECT_THAT(d.Wait(seconds(30)), StatusIs(Code::kDeadlineExceeded));

        Transfer u = ValueOrDie(agent_->PostRead(local, agent_->name(), remote));
        FERRY_ASSERT_OK(agent_->Deregister(file.id));
        EXPECT_THAT(u.Wait(seconds(30)), StatusIs(Code::kCancelled));
    }
    // The disk is back: a transfer completes and brings the right bytes.
    RegionInfo again =
        ValueOrDie(agent_->RegisterFile(dir_.File("stall.bin"), 0, kBytes, {.create = true}));
    remote[0].region = again.id;
    FERRY_ASSERT_OK(Run(false, local, remote));
    std::vector<uint8_t> expect(kBytes);
    FillPattern(expect.data(), kBytes, 7);
    EXPECT_EQ(ReadFile(dir_.File("stall.bin"), 0, kBytes), expect);
    // Destroying the agent with a batch held.
    {
        internal::FileStallGuard stall;
        Transfer x = ValueOrDie(agent_->PostRead(local, agent_->name(), remote));
        agent_.reset();
        EXPECT_THAT(x.Wait(seconds(30)), StatusIs(Code::kCancelled));
    }
}

TEST_P(LocalFileTransfers, ConcurrentTransfersFromSeveralThreads) {
    const uint64_t block = 1u << 20;
    const int threads = 4, rounds = 8;
    RegionInfo mem = ValueOrDie(agent_->AllocateRegion(threads * 2 * block));
    RegionInfo file =
        ValueOrDie(agent_->RegisterFile(dir_.File("c.bin"), 0, threads * block, {.create = true}));
    std::atomic<int> failures{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
        ts.emplace_back([&, t] {
            uint8_t* out = static_cast<uint8_t*>(mem.base) + 2 * t * block;
            uint8_t* in = out + block;
            for (int r = 0; r < rounds; ++r) {
                uint64_t seed = 1000 * t + r;
                FillPattern(out, block, seed);
                if (!Run(false, {{mem.id, 2 * t * block, block}}, {{file.id, t * block, block}})
                         .ok() ||
                    !Run(true, {{mem.id, (2 * t + 1) * block, block}},
                         {{file.id, t * block, block}})
                         .ok() ||
                    FirstMismatch(in, block, seed) != -1) {
                    ++failures;
                }
            }
        });
    }
    for (auto& t : ts) t.join();
    EXPECT_EQ(failures.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(FileIo, LocalFileTransfers, ::testing::Values("io_uring", "pread"),
                         [](const auto& info) { return info.param; });

TEST(FileConfig, BadFileOptionsAreRefused) {
    EXPECT_THAT(Agent::Create({.name = "x", .file_io = "aio"}),
                StatusHas(Code::kInvalidArgument, "file_io"));
    EXPECT_THAT(Agent::Create({.name = "x", .file_queue_depth = 0}),
                StatusHas(Code::kInvalidArgument, "file_queue_depth"));
}

// --- a peer's file regions, over every network backend ("remote NVMe") -----------------------

class RemoteFileConformance : public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        pair_ = MakePair(GetParam());
        a_ = pair_.a.get();
        b_ = pair_.b.get();
        ASSERT_TRUE(a_->AddPeer(b_->Metadata()).ok());
        ASSERT_TRUE(b_->AddPeer(a_->Metadata()).ok());
    }
    void RefreshB() { ASSERT_TRUE(a_->AddPeer(b_->Metadata()).ok()); }
    Status Run(bool read, const std::vector<Descriptor>& local,
               const std::vector<Descriptor>& remote, TransferOptions opts = {}) {
        auto x = read ? a_->PostRead(local, "agent-b", remote, opts)
                      : a_->PostWrite(local, "agent-b", remote, opts);
        if (!x.ok()) return x.status();
        return x->Wait(seconds(60));
    }
    TempDir dir_;
    testing::AgentPair pair_;
    Agent* a_ = nullptr;
    Agent* b_ = nullptr;
};

TEST_P(RemoteFileConformance, PeersReadAndWriteAFileRegionOfEverySize) {
    const uint64_t kRegion = 32u << 20;
    RegionInfo la = ValueOrDie(a_->AllocateRegion(kRegion));
    const std::string path = dir_.File("remote.bin");
    RegionInfo fb = ValueOrDie(b_->RegisterFile(path, 8192, kRegion, {.create = true}));
    RefreshB();
    uint64_t seed = 100;
    for (uint64_t size :
         {uint64_t{1}, uint64_t{4096}, uint64_t{65537}, uint64_t{(1u << 20) + 3}, kRegion}) {
        SCOPED_TRACE("size " + std::to_string(size));
        const uint64_t at = size == kRegion ? 0 : 77;
        FillPattern(la.base, size, ++seed);
        FERRY_ASSERT_OK(Run(false, {{la.id, 0, size}}, {{fb.id, at, size}}));
        // When the WRITE reports done, the bytes are in b's file.
        EXPECT_EQ(FirstMismatch(ReadFile(path, 8192 + at, size).data(), size, seed), -1);
        std::memset(la.base, 0, size);
        FERRY_ASSERT_OK(Run(true, {{la.id, 0, size}}, {{fb.id, at, size}}));
        EXPECT_EQ(FirstMismatch(la.base, size, seed), -1);
    }
}

TEST_P(RemoteFileConformance, OneTransferAcrossMemoryAndFileRegionsOfThePeer) {
    const uint64_t block = 65536;
    RegionInfo la = ValueOrDie(a_->AllocateRegion(8 * block));
    RegionInfo mb = ValueOrDie(b_->AllocateRegion(4 * block));
    RegionInfo fb =
        ValueOrDie(b_->RegisterFile(dir_.File("mix.bin"), 0, 4 * block, {.create = true}));
    RefreshB();
    FillPattern(la.base, 8 * block, 31);
    std::vector<Descriptor> remote;
    for (uint64_t i = 0; i < 4; ++i) {  // alternate: file, memory, file, ...
        remote.push_back({fb.id, i * block, block});
        remote.push_back({mb.id, i * block, block});
    }
    FERRY_ASSERT_OK(Run(false, {{la.id, 0, 8 * block}}, remote));
    std::vector<uint8_t> expect(8 * block);
    FillPattern(expect.data(), expect.size(), 31);
    std::vector<uint8_t> disk = ReadFile(dir_.File("mix.bin"), 0, 4 * block);
    for (uint64_t i = 0; i < 4; ++i) {
        EXPECT_EQ(std::memcmp(disk.data() + i * block, expect.data() + 2 * i * block, block), 0);
        EXPECT_EQ(std::memcmp(static_cast<uint8_t*>(mb.base) + i * block,
                              expect.data() + (2 * i + 1) * block, block),
                  0);
    }
    std::memset(la.base, 0, 8 * block);
    FERRY_ASSERT_OK(Run(true, {{la.id, 0, 8 * block}}, remote));
    EXPECT_EQ(FirstMismatch(la.base, 8 * block, 31), -1);
}

TEST_P(RemoteFileConformance, TheTargetRefusesWhatItsFileRegionsForbidAndKeepsServing) {
    RegionInfo la = ValueOrDie(a_->AllocateRegion(1 << 20));
    std::vector<uint8_t> content(1 << 20);
    FillPattern(content.data(), content.size(), 8);
    WriteFile(dir_.File("ro.bin"), content);
    RegionInfo ro =
        ValueOrDie(b_->RegisterFile(dir_.File("ro.bin"), 0, 1 << 20, {.read_only = true}));
    bool direct = DirectIoWorks(dir_.File("probe"));
    RegionInfo dio{};
    if (direct) {
        dio = ValueOrDie(
            b_->RegisterFile(dir_.File("d.bin"), 0, 1 << 20, {.create = true, .direct = true}));
    }
    RefreshB();
    EXPECT_THAT(Run(false, {{la.id, 0, 4096}}, {{ro.id, 0, 4096}}),
                StatusHas(Code::kPermissionDenied, "read-only"));
    EXPECT_EQ(ReadFile(dir_.File("ro.bin"), 0, 1 << 20), content);
    FERRY_ASSERT_OK(Run(true, {{la.id, 0, 1 << 20}}, {{ro.id, 0, 1 << 20}}));
    EXPECT_EQ(FirstMismatch(la.base, 1 << 20, 8), -1);
    if (direct) {
        // The target stages through aligned memory: any local memory works, but the file range
        // must be aligned.
        FillPattern(la.base, 8195, 9);
        FERRY_ASSERT_OK(Run(false, {{la.id, 3, 8192}}, {{dio.id, 4096, 8192}}));
        EXPECT_THAT(Run(false, {{la.id, 0, 100}}, {{dio.id, 0, 100}}),
                    StatusHas(Code::kInvalidArgument, "O_DIRECT"));
        std::memset(la.base, 0, 8192);
        FERRY_ASSERT_OK(Run(true, {{la.id, 0, 8192}}, {{dio.id, 4096, 8192}}));
        std::vector<uint8_t> expect(8195);
        FillPattern(expect.data(), 8195, 9);
        EXPECT_EQ(std::memcmp(la.base, expect.data() + 3, 8192), 0);
    }
    // A local file region cannot be the local side of a transfer with a peer.
    RegionInfo lf = ValueOrDie(a_->RegisterFile(dir_.File("local.bin"), 0, 4096, {.create = true}));
    EXPECT_THAT(Run(false, {{lf.id, 0, 4096}}, {{ro.id, 0, 4096}}),
                StatusHas(Code::kInvalidArgument, "file region"));
    // Deregistered: NotFound, and b serves on.
    FERRY_ASSERT_OK(b_->Deregister(ro.id));
    EXPECT_THAT(Run(true, {{la.id, 0, 4096}}, {{ro.id, 0, 4096}}), StatusIs(Code::kNotFound));
    RegionInfo mb = ValueOrDie(b_->AllocateRegion(4096));
    RefreshB();
    FERRY_EXPECT_OK(Run(true, {{la.id, 0, 4096}}, {{mb.id, 0, 4096}}));
}

TEST_P(RemoteFileConformance, AFileThatShrankAtTheTargetFailsTheReadAndTheTargetServesOn) {
    RegionInfo la = ValueOrDie(a_->AllocateRegion(1 << 20));
    RegionInfo fb =
        ValueOrDie(b_->RegisterFile(dir_.File("shrink.bin"), 0, 1 << 20, {.create = true}));
    RegionInfo mb = ValueOrDie(b_->AllocateRegion(4096));
    RefreshB();
    ASSERT_EQ(truncate(dir_.File("shrink.bin").c_str(), 1000), 0);  // someone else truncates it
    // The target's staged file read fails; the initiator hears why (from the first chunk that
    // fails: transfers are split across streams).
    EXPECT_THAT(Run(true, {{la.id, 0, 1 << 20}}, {{fb.id, 0, 1 << 20}}),
                StatusHas(Code::kOutOfRange, "the file ends at offset"));
    FillPattern(mb.base, 4096, 12);
    FERRY_ASSERT_OK(Run(true, {{la.id, 0, 4096}}, {{mb.id, 0, 4096}}));
    EXPECT_EQ(FirstMismatch(la.base, 4096, 12), -1);
}

TEST_P(RemoteFileConformance, TiedNotificationArrivesAfterTheBytesAreInTheFile) {
    const uint64_t kBytes = 8u << 20;
    RegionInfo la = ValueOrDie(a_->AllocateRegion(kBytes));
    RegionInfo fb = ValueOrDie(b_->RegisterFile(dir_.File("n.bin"), 0, kBytes, {.create = true}));
    RefreshB();
    for (int round = 0; round < 3; ++round) {
        FillPattern(la.base, kBytes, 60 + round);
        std::vector<Descriptor> local = {{la.id, 0, kBytes}}, remote = {{fb.id, 0, kBytes}};
        Transfer t = ValueOrDie(a_->PostWrite(
            local, "agent-b", remote, {.notification = "kv-ready-" + std::to_string(round)}));
        std::vector<Notification> got;
        auto deadline = Clock::now() + seconds(30);
        while (got.empty() && Clock::now() < deadline) {
            got = b_->WaitNotifications(deadline);
        }
        ASSERT_EQ(got.size(), 1u);
        EXPECT_EQ(got[0].payload, "kv-ready-" + std::to_string(round));
        EXPECT_EQ(FirstMismatch(ReadFile(dir_.File("n.bin"), 0, kBytes).data(), kBytes, 60 + round),
                  -1);
        FERRY_ASSERT_OK(t.Wait(seconds(30)));
    }
}

TEST_P(RemoteFileConformance, MetadataNamesFileRegions) {
    RegionInfo fb = ValueOrDie(b_->RegisterFile(dir_.File("m.bin"), 0, 4096, {.create = true}));
    RefreshB();
    RegionInfo la = ValueOrDie(a_->AllocateRegion(4096));
    // The region is known to a (no NotFound before posting) and of kind file on b.
    FERRY_EXPECT_OK(Run(true, {{la.id, 0, 4096}}, {{fb.id, 0, 4096}}));
    bool found = false;
    for (const RegionInfo& r : b_->Regions()) {
        if (r.id == fb.id) {
            found = true;
            EXPECT_EQ(r.kind, MemoryKind::kFile);
        }
    }
    EXPECT_TRUE(found);
}

INSTANTIATE_TEST_SUITE_P(Backends, RemoteFileConformance,
                         ::testing::ValuesIn(testing::ConformanceVariants()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry
