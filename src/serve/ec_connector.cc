#include "serve/ec_connector.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "core/clock.h"
#include "core/crypto.h"
#include "core/host_port.h"
#include "core/log.h"
#include "core/named_registry.h"
#include "media/embeddings_file.h"

namespace ferry::serve {

namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// A consumer's Load in its connector's stats (the caller holds their lock).
void CountLoad(EcConnectorStats* s, Clock::time_point t0, size_t floats, const Status& st) {
    s->load_micros += MicrosSince(t0);
    if (st.ok()) {
        ++s->loads;
        s->load_bytes += floats * sizeof(float);
    } else if (st.code() == Code::kNotFound) {
        ++s->load_misses;
    } else {
        ++s->load_failures;
        if (st.code() == Code::kFailedPrecondition) ++s->load_foreign;
    }
}

// The notification a consumer sends after pulling (it ends the slot's lease).
constexpr std::string_view kReleasePrefix = "ferry-ec-release:";
// The notification a consumer whose request waits to load entries sends:
// "ferry-ec-renew:LEASE_MS:HASH,HASH,...".
constexpr std::string_view kRenewPrefix = "ferry-ec-renew:";

// A slot: this header, then the payload (entry_floats floats).
struct SlotHeader {
    char magic[8];        // "FERRYEC2" (1: without the encoder fingerprint)
    char mm_hash[64];     // hex
    uint64_t floats;      // payload length in floats
    uint64_t checksum;    // XXH3-64 of the payload
    uint64_t generation;  // bumped on each write (diagnostics)
    char encoder[32];     // the producer's vision encoder fingerprint (hex, zero-padded)
};
static_assert(sizeof(SlotHeader) == 128);
constexpr char kMagic[8] = {'F', 'E', 'R', 'R', 'Y', 'E', 'C', '2'};

// --- transfer -----------------------------------------------------------------------------

class TransferEcConnector final : public EcConnector {
  public:
    explicit TransferEcConnector(EcConnectorConfig c)
        : EcConnector("transfer"), cfg_(std::move(c)) {}
    ~TransferEcConnector() override {
        {
            std::lock_guard lock(mu_);
            stop_ = true;
        }
        if (thread_.joinable()) thread_.join();
        std::lock_guard lock(mu_);
        for (const auto& [hash, slot] : by_hash_) (void)cfg_.agent->Unpublish(EcObjectKey(hash));
        if (region_.length) (void)cfg_.agent->Deregister(region_.id);
        if (scratch_.length) (void)cfg_.agent->Deregister(scratch_.id);
    }

    Status Start() {
        slot_bytes_ = sizeof(SlotHeader) + cfg_.entry_floats * sizeof(float);
        if (!cfg_.producer) return Status::Ok();
        const uint64_t n = cfg_.buffer_bytes / slot_bytes_;
        if (n == 0) {
            return InvalidArgumentError(
                fmt::format("--ec-buffer-mib: {} bytes hold no image's embeddings ({} bytes each)",
                            cfg_.buffer_bytes, slot_bytes_));
        }
        FERRY_ASSIGN_OR_RETURN(region_, cfg_.agent->AllocateRegion(n * slot_bytes_));
        slots_.resize(n);
        for (size_t i = 0; i < n; ++i) free_.push_back(i);
        thread_ = std::thread([this] { Leases(); });
        return Status::Ok();
    }

    Status Save(const std::string& mm_hash, const std::vector<float>& floats) override {
        if (!cfg_.producer) return FailedPreconditionError("ec: this worker is no producer");
        if (!media::IsMmHash(mm_hash) || floats.size() != cfg_.entry_floats) {
            return InvalidArgumentError("ec: an entry of the wrong shape");
        }
        std::lock_guard lock(mu_);
        const Clock::time_point lease_end = Clock::now() + cfg_.lease;
        if (auto it = by_hash_.find(mm_hash); it != by_hash_.end()) {
            // Already published (a repeated image): a new lease for its new consumer. The slot
            // stays leased until every consumer it was leased to has released it (or the
            // lease lapses): one consumer's release must not free it under another.
            Slot& s = slots_[it->second];
            if (!s.leased) {
                lru_.erase(s.lru);
                s.leased = true;
                ++leased_;
            }
            ++s.holders;
            s.lease_end = std::max(s.lease_end, lease_end);
            ++stats_.saved;
            return Status::Ok();
        }
        size_t i;
        if (!free_.empty()) {
            i = free_.front();
            free_.pop_front();
        } else if (!lru_.empty()) {
            i = lru_.back();  // the least recently written entry nobody holds a lease on
            lru_.pop_back();
            Slot& old = slots_[i];
            (void)cfg_.agent->Unpublish(EcObjectKey(old.hash));
            by_hash_.erase(old.hash);
        } else {
            ++stats_.save_refused;
            return ResourceExhaustedError(fmt::format(
                "ec: all {} slots of the encoder cache's transfer buffer are leased to consumers "
                "that have not pulled them yet (--ec-buffer-mib, --ec-lease-ms)",
                slots_.size()));
        }
        auto* base = static_cast<std::byte*>(region_.base) + i * slot_bytes_;
        SlotHeader h{};
        std::memcpy(h.magic, kMagic, sizeof(kMagic));
        std::memcpy(h.mm_hash, mm_hash.data(), 64);
        h.floats = floats.size();
        h.checksum = media::EmbeddingsChecksum(floats.data(), floats.size() * sizeof(float));
        h.generation = ++generation_;
        std::memcpy(h.encoder, cfg_.encoder.data(),
                    std::min(cfg_.encoder.size(), sizeof(h.encoder)));
        std::memcpy(base + sizeof(SlotHeader), floats.data(), floats.size() * sizeof(float));
        std::memcpy(base, &h, sizeof(h));
        Status st =
            cfg_.agent->Publish(EcObjectKey(mm_hash), {{region_.id, i * slot_bytes_, slot_bytes_}});
        if (!st.ok()) {
            free_.push_back(i);
            return st;
        }
        Slot& s = slots_[i];
        s.hash = mm_hash;
        s.leased = true;
        s.holders = 1;
        s.lease_end = lease_end;
        ++leased_;
        by_hash_[mm_hash] = i;
        ++stats_.saved;
        return Status::Ok();
    }

    Result<media::Embeddings> Load(const std::string& mm_hash, size_t floats,
                                   const EcSource* source) override {
        const Clock::time_point t0 = Clock::now();
        Result<media::Embeddings> r =
            source ? Pull(mm_hash, floats, *source) : PullFromAny(mm_hash, floats);
        std::lock_guard lock(mu_);
        CountLoad(&stats_, t0, floats, r.status());
        if (!source && r.ok()) ++stats_.found_by_hash;
        return r;
    }

    bool FindsWithoutParams() const override { return cfg_.producers && !cfg_.producers().empty(); }

    void Release(const std::string& mm_hash, const EcSource* source) override {
        if (!source || !media::IsMmHash(mm_hash)) return;
        Result<std::string> peer = PeerFor(*source);
        if (!peer.ok()) return;  // gone: its lease lapses
        if (cfg_.agent->Notify(*peer, std::string(kReleasePrefix) + mm_hash).ok()) {
            std::lock_guard lock(mu_);
            ++stats_.released_unpulled;
        }
    }

    void Renew(const EcSource& source, std::chrono::milliseconds lease) override {
        if (source.mm_hashes.empty() || cfg_.producer) return;
        // Only to a producer already connected: this runs where a request arrives, which must
        // not wait for a dial (the load dials, later, on the media queue's thread).
        std::optional<std::string> peer;
        {
            std::lock_guard lock(mu_);
            peer = ConnectedLocked(source);
        }
        if (!peer) return;
        std::string note = fmt::format("{}{}:", kRenewPrefix, lease.count());
        for (size_t i = 0; i < source.mm_hashes.size(); ++i) {
            if (i) note += ',';
            note += source.mm_hashes[i];
        }
        if (cfg_.agent->Notify(*peer, note).ok()) {
            std::lock_guard lock(mu_);
            ++stats_.renewals_sent;
        }
    }

    bool Cacheable() const override { return cfg_.trust.deployment_only(); }

    Json Params() const override {
        if (!cfg_.producer) return nullptr;
        EcSource p;
        static_cast<schema::AgentAddress&>(p) =
            schema::AgentAt(cfg_.agent->name(), cfg_.agent->ListenAddress());
        p.encoder = cfg_.encoder;
        return schema::EcTransferParamsJson(p);
    }

    EcConnectorStats Stats() const override {
        std::lock_guard lock(mu_);
        EcConnectorStats s = stats_;
        s.leased = leased_;
        s.entries = by_hash_.size();
        s.slots = slots_.size();
        return s;
    }

  private:
    struct Slot {
        std::string hash;
        bool leased = false;
        uint32_t holders = 0;  // consumers it was leased to that have not released it
        Clock::time_point lease_end{};
        std::list<size_t>::iterator lru{};  // valid while not leased
    };

    // No encode worker named (vLLM's EPD proxy): each the deployment knows is asked for the
    // image by its hash; the first that holds it (for this worker's encoder) wins. NotFound when
    // none holds it; otherwise the first other failure (a producer unreachable, a foreign
    // encoder), which the caller's --ec-load-failure then decides on.
    Result<media::Embeddings> PullFromAny(const std::string& mm_hash, size_t floats) {
        std::vector<EcSource> producers;
        if (cfg_.producers) producers = cfg_.producers();
        if (producers.empty()) return NotFoundError("ec: no encode worker named or known");
        Status failed = Status::Ok();
        for (const EcSource& p : producers) {
            // One that could not be reached is skipped for a while, so a host that went dark
            // costs one dial timeout, not one per image.
            const std::string address = FormatHostPort(p.host, p.port);
            {
                std::lock_guard lock(mu_);
                auto it = unreachable_.find(address);
                if (it != unreachable_.end() && Clock::now() < it->second) {
                    if (failed.ok()) {
                        failed = UnavailableError(fmt::format(
                            "ec: the encode worker at {} did not answer lately", address));
                    }
                    continue;
                }
            }
            Result<media::Embeddings> r = Pull(mm_hash, floats, p);
            if (r.ok()) return r;
            if (r.status().code() == Code::kUnavailable ||
                r.status().code() == Code::kDeadlineExceeded) {
                std::lock_guard lock(mu_);
                unreachable_[address] = Clock::now() + kSkipUnreachable;
            }
            if (r.status().code() != Code::kNotFound && failed.ok()) failed = r.status();
        }
        if (!failed.ok()) return failed;
        return NotFoundError(fmt::format("ec: none of the {} encode workers known holds image {}",
                                         producers.size(), mm_hash));
    }

    // The producer's agent as a peer of this one: connected once, by name through the store,
    // or at the params' address (only one --ec-peers / --kv-peers allows, if given). A source
    // with no engine_id (an address the operator listed) is taken under the name it gives.
    // Under mu_: the agent `src` names when this consumer is connected to it already.
    std::optional<std::string> ConnectedLocked(const EcSource& src) const {
        if (!src.engine_id.empty()) {
            if (connected_.count(src.engine_id)) return src.engine_id;
            return std::nullopt;
        }
        auto it = by_address_.find(FormatHostPort(src.host, src.port));
        if (it != by_address_.end()) return it->second;
        return std::nullopt;
    }
    Result<std::string> PeerFor(const EcSource& src) {
        const std::string address = FormatHostPort(src.host, src.port);
        {
            std::lock_guard lock(mu_);
            if (std::optional<std::string> known = ConnectedLocked(src)) return *known;
        }
        Result<std::string> name = [&]() -> Result<std::string> {
            if (!cfg_.trust.allowed_agents.empty()) {
                if (!cfg_.trust.Listed(address)) {
                    return PermissionDeniedError(fmt::format(
                        "ec_transfer_params: the agent at {} is not one this worker may dial "
                        "(--kv-peers)",
                        address));
                }
                return cfg_.agent->Connect(address, cfg_.pull_timeout);
            }
            if (cfg_.trust.by_store && !src.engine_id.empty()) {
                return cfg_.agent->ConnectByName(src.engine_id);
            }
            return cfg_.agent->Connect(address, cfg_.pull_timeout);
        }();
        if (!name.ok()) {
            return UnavailableError(fmt::format("ec: the encode worker's agent '{}' at {}: {}",
                                                src.engine_id, address, name.status().message()));
        }
        if (src.engine_id.empty()) {
            std::lock_guard lock(mu_);
            by_address_[address] = *name;
            connected_.insert(*name);
            return *name;
        }
        if (*name != src.engine_id) {
            (void)cfg_.agent->RemovePeer(*name);
            return UnavailableError(
                fmt::format("ec: the agent at {} is '{}', not '{}' (restarted or moved)", address,
                            *name, src.engine_id));
        }
        std::lock_guard lock(mu_);
        connected_.insert(*name);
        return *name;
    }

    Result<media::Embeddings> Pull(const std::string& mm_hash, size_t floats,
                                   const EcSource& source) {
        if (floats != cfg_.entry_floats) {
            return InvalidArgumentError("ec: an entry of the wrong shape");
        }
        if (!source.encoder.empty() && source.encoder != cfg_.encoder) {
            // Said before anything moves: the lease ends now, nothing is pulled.
            Release(mm_hash, &source);
            return ForeignEncoder(mm_hash, source.engine_id, source.encoder);
        }
        FERRY_ASSIGN_OR_RETURN(std::string peer, PeerFor(source));
        // One pull at a time into one scratch slot (the media thread is the only caller).
        std::lock_guard pull_lock(pull_mu_);
        if (!scratch_.length) {
            FERRY_ASSIGN_OR_RETURN(scratch_, cfg_.agent->AllocateRegion(slot_bytes_));
        }
        Result<PullResult> got = cfg_.agent->PullByKey(
            peer, EcObjectKey(mm_hash), {scratch_.id, 0, slot_bytes_}, cfg_.pull_timeout);
        if (!got.ok()) {
            if (got.status().code() == Code::kNotFound) {
                return NotFoundError(
                    fmt::format("ec: {} has no embeddings for image {}", peer, mm_hash));
            }
            if (got.status().code() == Code::kUnavailable) {
                std::lock_guard lock(mu_);
                connected_.erase(peer);  // dial again next time (it may have restarted)
                for (auto it = by_address_.begin(); it != by_address_.end();) {
                    it = it->second == peer ? by_address_.erase(it) : std::next(it);
                }
            }
            return got.status().WithContext("ec pull");
        }
        if (!got->copied || got->object_size != slot_bytes_) {
            return DataLossError(fmt::format("ec: {} sent {} bytes for image {}, expected {}", peer,
                                             got->object_size, mm_hash, slot_bytes_));
        }
        const auto* base = static_cast<const std::byte*>(scratch_.base);
        SlotHeader h;
        std::memcpy(&h, base, sizeof(h));
        auto e = std::make_shared<std::vector<float>>(floats);
        std::memcpy(e->data(), base + sizeof(SlotHeader), floats * sizeof(float));
        if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 ||
            std::string_view(h.mm_hash, 64) != mm_hash || h.floats != floats ||
            h.checksum != media::EmbeddingsChecksum(e->data(), floats * sizeof(float))) {
            // The slot was reused while it was read (its lease had ended): not this image's.
            return NotFoundError(fmt::format(
                "ec: the slot {} sent for image {} did not hold it whole", peer, mm_hash));
        }
        // The lease can end now; nobody waits for this.
        (void)cfg_.agent->Notify(peer, std::string(kReleasePrefix) + mm_hash);
        const std::string_view theirs(h.encoder, strnlen(h.encoder, sizeof(h.encoder)));
        if (theirs != cfg_.encoder) return ForeignEncoder(mm_hash, peer, theirs);
        return media::Embeddings(std::move(e));
    }

    Status ForeignEncoder(const std::string& mm_hash, std::string_view peer,
                          std::string_view theirs) const {
        return FailedPreconditionError(fmt::format(
            "ec: the embeddings of image {} at encode worker '{}' were computed by vision "
            "encoder {}; this worker's is {} (their --mmproj differs): not used",
            mm_hash, peer, theirs.empty() ? std::string_view("(none named)") : theirs,
            cfg_.encoder));
    }

    // Producer: ends leases that consumers released or that ran out.
    void Leases() {
        for (;;) {
            std::vector<Notification> notes =
                cfg_.agent->WaitNotifications(Clock::now() + std::chrono::milliseconds(100));
            std::lock_guard lock(mu_);
            if (stop_) return;
            const Clock::time_point now = Clock::now();
            for (const Notification& n : notes) {
                if (n.payload.rfind(kRenewPrefix, 0) == 0) {
                    RenewLocked(n.payload.substr(kRenewPrefix.size()), now);
                    continue;
                }
                if (n.payload.rfind(kReleasePrefix, 0) != 0) continue;
                auto it = by_hash_.find(n.payload.substr(kReleasePrefix.size()));
                if (it == by_hash_.end() || !slots_[it->second].leased) continue;
                ++stats_.released;
                if (--slots_[it->second].holders == 0) Unlease(it->second);
            }
            for (size_t i = 0; i < slots_.size(); ++i) {
                if (slots_[i].leased && now >= slots_[i].lease_end) {
                    Unlease(i);
                    ++stats_.lapsed;
                }
            }
        }
    }
    // Producer, under mu_: "LEASE_MS:HASH,HASH,..." from a consumer whose request waits to
    // load these entries. Each leased one lasts LEASE_MS (at most the producer's lease) from
    // now: a slot leased to that consumer alone may end sooner than its first lease (a consumer
    // that then dies frees it that soon); one leased to several is only ever extended. Not
    // leased (released, lapsed, unknown), or malformed: nothing.
    void RenewLocked(std::string_view body, Clock::time_point now) {
        const size_t colon = body.find(':');
        if (colon == std::string_view::npos) return;
        int64_t ms = 0;
        const auto [end_ms, ec] = std::from_chars(body.data(), body.data() + colon, ms);
        if (ec != std::errc() || end_ms != body.data() + colon || ms <= 0) return;
        const Clock::time_point end =
            now + std::min<std::chrono::milliseconds>(std::chrono::milliseconds(ms), cfg_.lease);
        body.remove_prefix(colon + 1);
        for (size_t n = 0; !body.empty() && n < schema::kMaxEcHashes; ++n) {
            const size_t comma = body.find(',');
            const std::string_view hash = body.substr(0, comma);
            body.remove_prefix(comma == std::string_view::npos ? body.size() : comma + 1);
            auto it = by_hash_.find(std::string(hash));
            if (it == by_hash_.end() || !slots_[it->second].leased) continue;
            Slot& slot = slots_[it->second];
            slot.lease_end = slot.holders <= 1 ? end : std::max(slot.lease_end, end);
            ++stats_.renewed;
        }
    }
    void Unlease(size_t i) {
        Slot& s = slots_[i];
        s.leased = false;
        s.holders = 0;
        --leased_;
        lru_.push_front(i);
        s.lru = lru_.begin();
    }

    EcConnectorConfig cfg_;
    size_t slot_bytes_ = 0;
    mutable std::mutex mu_;
    bool stop_ = false;
    RegionInfo region_{};  // producer: the slots
    std::vector<Slot> slots_;
    std::list<size_t> free_;
    std::list<size_t> lru_;  // unleased slots in use, most recently released first
    std::unordered_map<std::string, size_t> by_hash_;
    uint64_t leased_ = 0;
    uint64_t generation_ = 0;
    EcConnectorStats stats_;
    std::thread thread_;
    // Consumer.
    std::unordered_set<std::string> connected_;
    std::unordered_map<std::string, std::string> by_address_;  // listed address -> agent name
    // PullFromAny: addresses that did not answer, skipped until then.
    std::unordered_map<std::string, Clock::time_point> unreachable_;
    static constexpr std::chrono::seconds kSkipUnreachable{2};
    std::mutex pull_mu_;
    RegionInfo scratch_{};
};

// --- disk ---------------------------------------------------------------------------------

class DiskEcConnector final : public EcConnector {
  public:
    explicit DiskEcConnector(EcConnectorConfig c) : EcConnector("disk"), cfg_(std::move(c)) {}

    Status Save(const std::string& mm_hash, const std::vector<float>& floats) override {
        if (!media::IsMmHash(mm_hash) || floats.empty() || floats.size() % Width() != 0) {
            return InvalidArgumentError("ec: an entry of the wrong shape");
        }
        const std::string dir = cfg_.dir + "/" + mm_hash;
        const std::string path = dir + "/encoder_cache.safetensors";
        if (access(path.c_str(), R_OK) == 0) {
            // Another producer (or an earlier request) wrote it: the same pixels, the same rows.
            std::lock_guard lock(mu_);
            ++stats_.saved;
            return Status::Ok();
        }
        if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
            return InternalError(fmt::format("ec: mkdir {}: {}", dir, std::strerror(errno)));
        }
        Result<uint64_t> written = media::WriteEmbeddingsFile(
            path, floats, Width(),
            {{"producer", "ferry"}, {"mm_hash", mm_hash}, {"encoder", cfg_.encoder}});
        if (!written.ok()) return InternalError("ec: " + written.status().message());
        std::lock_guard lock(mu_);
        ++stats_.saved;
        return Status::Ok();
    }

    Result<media::Embeddings> Load(const std::string& mm_hash, size_t floats,
                                   const EcSource*) override {
        const Clock::time_point t0 = Clock::now();
        Result<media::Embeddings> r = Read(mm_hash, floats);
        std::lock_guard lock(mu_);
        CountLoad(&stats_, t0, floats, r.status());
        return r;
    }

    bool Cacheable() const override { return true; }  // the operator's directory
    Json Params() const override { return nullptr; }
    bool FindsWithoutParams() const override { return true; }

    EcConnectorStats Stats() const override {
        std::lock_guard lock(mu_);
        return stats_;
    }

  private:
    size_t Width() const { return cfg_.width ? cfg_.width : 1; }

    Result<media::Embeddings> Read(const std::string& mm_hash, size_t floats) {
        if (!media::IsMmHash(mm_hash)) return InvalidArgumentError("ec: not an mm_hash");
        const std::string path = cfg_.dir + "/" + mm_hash + "/encoder_cache.safetensors";
        media::FileMetadata meta;
        Result<media::Embeddings> r = media::ReadEmbeddingsFile(path, floats, Width(), &meta);
        if (!r.ok()) {
            if (r.status().code() == Code::kNotFound) {
                return NotFoundError("ec: no file for image " + mm_hash);
            }
            return r.status().WithContext("ec");
        }
        if (meta["mm_hash"] != mm_hash) {
            // A whole file of another image (copied or moved under this name): not this one's.
            return DataLossError(fmt::format("ec: {} holds the embeddings of image {}", path,
                                             meta["mm_hash"].empty()
                                                 ? std::string("(unnamed)")
                                                 : meta["mm_hash"].substr(0, 64)));
        }
        // Kept for whoever wrote it (another deployment may share the directory); not used here.
        if (meta["encoder"] != cfg_.encoder) {
            return FailedPreconditionError(fmt::format(
                "ec: {} was written by vision encoder {}; this worker's is {} (their --mmproj "
                "differs): not used",
                path, meta["encoder"].empty() ? "(none named)" : meta["encoder"].substr(0, 64),
                cfg_.encoder));
        }
        return r;
    }

    EcConnectorConfig cfg_;
    mutable std::mutex mu_;
    EcConnectorStats stats_;
};

}  // namespace

std::string EcObjectKey(std::string_view mm_hash) { return "mm:" + std::string(mm_hash); }

Result<EcLoadFailure> ParseEcLoadFailure(std::string_view name) {
    if (name == "encode") return EcLoadFailure::kEncode;
    if (name == "fail") return EcLoadFailure::kFail;
    return InvalidArgumentError(
        fmt::format("--ec-load-failure '{}' is not one of encode, fail", name));
}

namespace {

NamedRegistry<EcConnectorKind>& TheEcRegistry() {
    static auto* r = [] {
        auto* reg = new NamedRegistry<EcConnectorKind>("--ec-connector");
        EcConnectorKind transfer;
        transfer.name = "transfer";
        transfer.description =
            "pulled by mm_hash from the encode worker's agent in one round trip (shm, tcp, ucx)";
        transfer.needs_agent = true;
        transfer.create = [](EcConnectorConfig c) -> Result<std::shared_ptr<EcConnector>> {
            if (!c.agent) return InvalidArgumentError("--ec-connector transfer needs an agent");
            if (c.entry_floats == 0) return InvalidArgumentError("ec: no entry size");
            auto t = std::make_shared<TransferEcConnector>(std::move(c));
            FERRY_RETURN_IF_ERROR(t->Start());
            return std::shared_ptr<EcConnector>(std::move(t));
        };
        EcConnectorKind disk;
        disk.name = "disk";
        disk.description = "a shared directory (--ec-dir), vLLM's ECExampleConnector layout";
        disk.create = [](EcConnectorConfig c) -> Result<std::shared_ptr<EcConnector>> {
            if (c.dir.empty()) return InvalidArgumentError("--ec-connector disk needs --ec-dir");
            struct stat st {};
            if (stat(c.dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
                return InvalidArgumentError(fmt::format("--ec-dir {}: not a directory", c.dir));
            }
            return std::shared_ptr<EcConnector>(std::make_shared<DiskEcConnector>(std::move(c)));
        };
        (void)reg->Add(std::move(transfer));
        (void)reg->Add(std::move(disk));
        return reg;
    }();
    return *r;
}

}  // namespace

Status RegisterEcConnector(EcConnectorKind kind) {
    if (kind.name.empty() || !kind.create) {
        return InvalidArgumentError("encoder-cache connector kinds need a name and create");
    }
    return TheEcRegistry().Add(std::move(kind));
}

Result<EcConnectorKind> FindEcConnector(std::string_view name) {
    return TheEcRegistry().Find(name);
}

std::vector<std::string> EcConnectorNames() { return TheEcRegistry().Names(); }

Result<std::shared_ptr<EcConnector>> MakeEcConnector(EcConnectorConfig c) {
    Result<EcConnectorKind> kind = FindEcConnector(c.kind);
    if (!kind.ok()) return InvalidArgumentError(kind.status().message());
    return kind->create(std::move(c));
}

}  // namespace ferry::serve
