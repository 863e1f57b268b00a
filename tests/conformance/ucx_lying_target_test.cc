// ucx peers that lie. The fake below is a real UCX peer (its own context, worker and progress
// thread) that speaks ferry's active-message protocol far enough to be reached: as a target it
// opens the reply endpoint an initiator announces (kAmHello) and answers grant requests
// (kAmGrant) the way its Answer says, from an honest grant of a mapped buffer to garbage; the
// initiator must fail that transfer with an error that names the lie, keep running, and keep
// serving and reaching everyone else. As an initiator it puts into an agent under an rkey it
// made up, never asking for a grant.
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "core/bytes.h"
#include "core/crypto.h"
#include "testing/testing.h"
#include "transfer/metadata.h"

namespace ferry {
namespace {

using ::ferry::testing::FillPattern;
using ::ferry::testing::FirstMismatch;
using ::ferry::testing::StatusHas;
using ::ferry::testing::TestConfig;
using ::ferry::testing::ValueOrDie;
using std::chrono::seconds;

// The protocol's active-message ids (ucx_backend.cc).
constexpr uint16_t kAmReply = 5;
constexpr uint16_t kAmHello = 6;
constexpr uint16_t kAmGrant = 8;
constexpr uint16_t kLastAm = 10;

enum class Answer {
    kHonest,              // maps its buffer and grants all of it
    kShortGrant,          // a real rkey, but a grant of 4 KiB of a larger region
    kTruncated,           // 8 bytes: not even an address and a length
    kGarbageRkey,         // address and length, then random bytes as the rkey
    kFewerBytesThanSaid,  // says 4000 bytes, sends 100
    kTooLong,             // more bytes than an answer may have
    kUnknownCode,         // a status code that does not exist
};

class FakeUcxPeer {
  public:
    static constexpr size_t kMemory = 1u << 20;

    explicit FakeUcxPeer(Answer answer) : answer_(answer), memory_(kMemory, 0) {
        ucp_params_t params{};
        params.field_mask = UCP_PARAM_FIELD_FEATURES;
        params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA;
        Check(ucp_init(&params, nullptr, &context_), "ucp_init");
        ucp_worker_params_t wp{};
        wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
        wp.thread_mode = UCS_THREAD_MODE_SINGLE;
        Check(ucp_worker_create(context_, &wp, &worker_), "ucp_worker_create");
        ucp_address_t* addr = nullptr;
        size_t addr_len = 0;
        Check(ucp_worker_get_address(worker_, &addr, &addr_len), "ucp_worker_get_address");
        address_ = HexEncode(reinterpret_cast<const uint8_t*>(addr), addr_len) +
                   ".00000000c0ffee01";  // its endpoint token
        ucp_worker_release_address(worker_, addr);
        for (uint16_t id = 1; id <= kLastAm; ++id) {
            args_[id] = {this, id};
            ucp_am_handler_param_t hp{};
            hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                            UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
            hp.id = id;
            hp.cb = &FakeUcxPeer::OnAm;
            hp.arg = &args_[id];
            hp.flags = UCP_AM_FLAG_WHOLE_MSG;
            Check(ucp_worker_set_am_recv_handler(worker_, &hp), "ucp_worker_set_am_recv_handler");
        }
        if (answer_ == Answer::kHonest || answer_ == Answer::kShortGrant) {
            ucp_mem_map_params_t mp{};
            mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
            mp.address = memory_.data();
            mp.length = memory_.size();
            Check(ucp_mem_map(context_, &mp, &memh_), "ucp_mem_map");
            void* packed = nullptr;
            size_t size = 0;
            Check(ucp_rkey_pack(context_, memh_, &packed, &size), "ucp_rkey_pack");
            rkey_.assign(static_cast<const char*>(packed), size);
            ucp_rkey_buffer_release(packed);
        }
        thread_ = std::thread([this] { Loop(); });
    }

    ~FakeUcxPeer() {
        stop_ = true;
        thread_.join();
        for (ucp_ep_h ep : eps_) {
            ucp_request_param_t p{};
            p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = UCP_EP_CLOSE_FLAG_FORCE;
            ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
            while (UCS_PTR_IS_PTR(r) && ucp_request_check_status(r) == UCS_INPROGRESS) {
                ucp_worker_progress(worker_);
            }
            if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
        }
        for (ucp_rkey_h k : rkeys_) ucp_rkey_destroy(k);
        if (memh_ != nullptr) ucp_mem_unmap(context_, memh_);
        ucp_worker_destroy(worker_);
        ucp_cleanup(context_);
    }

    // As an initiator: writes `data` to `remote` in the process of the ucx endpoint `agent`
    // (its published "<hex worker address>.<token>") with ucp_put_nbx under an rkey of its own
    // making (no memory domain: UCX's software emulation), never asking for a grant. True if
    // UCX confirmed the put (flush) within `wait`.
    bool PutUnasked(const std::string& agent, uint64_t remote, const std::string& data,
                    std::chrono::milliseconds wait) {
        auto done = std::make_shared<std::promise<bool>>();
        std::future<bool> f = done->get_future();
        {
            std::lock_guard<std::mutex> lock(mu_);
            commands_.push_back([this, agent, remote, data, wait, done] {
                done->set_value(DoPut(agent, remote, data, wait));
            });
        }
        return f.get();
    }

    // The "ucx" endpoint to publish in its metadata.
    const std::string& address() const { return address_; }
    const uint8_t* memory() const { return memory_.data(); }
    int grants_answered() const { return grants_answered_.load(); }

  private:
    struct HandlerArg {
        FakeUcxPeer* self = nullptr;
        uint16_t id = 0;
    };

    static void Check(ucs_status_t st, const char* what) {
        if (st != UCS_OK) {
            ADD_FAILURE() << what << ": " << ucs_status_string(st);
            std::abort();
        }
    }

    static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t*) {
        auto* a = static_cast<HandlerArg*>(arg);
        ByteReader r(std::string_view(static_cast<const char*>(header), header_length), "fake");
        uint64_t token = 0, proof = 0, initiator = 0, x = 0;
        if (!r.U64(&token) || !r.U64(&proof) || !r.U64(&initiator) || !r.U64(&x)) return UCS_OK;
        FakeUcxPeer* self = a->self;
        if (a->id == kAmHello) {
            std::string address(static_cast<const char*>(data), length);
            self->deferred_.push_back([self, address] { self->OpenReplyEp(address); });
        } else if (a->id == kAmGrant) {
            self->deferred_.push_back([self, request = x] { self->AnswerGrant(request); });
        }
        return UCS_OK;  // everything else is ignored
    }

    // An endpoint to the worker at `address` (its bytes), with peer error handling, closed
    // with the fake; nullptr if UCX refuses.
    ucp_ep_h Connect(const std::string& address) {
        ucp_ep_params_t params{};
        params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                            UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
        params.address = reinterpret_cast<const ucp_address_t*>(address.data());
        params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        params.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};
        ucp_ep_h ep = nullptr;
        if (ucp_ep_create(worker_, &params, &ep) != UCS_OK) return nullptr;
        eps_.push_back(ep);
        return ep;
    }

    void OpenReplyEp(const std::string& address) {
        if (ucp_ep_h ep = Connect(address)) reply_ep_ = ep;
    }

    void AnswerGrant(uint64_t request) {
        if (reply_ep_ == nullptr) return;
        uint8_t code = 0;
        std::string body;
        ByteWriter grant;
        grant.U64(reinterpret_cast<uint64_t>(memory_.data()));
        switch (answer_) {
            case Answer::kHonest:
                grant.U64(memory_.size());
                body = grant.Take() + rkey_;
                break;
            case Answer::kShortGrant:
                grant.U64(4096);
                body = grant.Take() + rkey_;
                break;
            case Answer::kTruncated:
                body = std::string(8, '\x01');
                break;
            case Answer::kGarbageRkey: {
                grant.U64(memory_.size());
                std::mt19937_64 rng(7);
                body = grant.Take();
                for (int i = 0; i < 512; ++i) body += static_cast<char>(rng());
                break;
            }
            case Answer::kFewerBytesThanSaid:
            case Answer::kTooLong:
                grant.U64(memory_.size());
                body = grant.Take() + std::string(answer_ == Answer::kTooLong ? 8192 : 84, 'x');
                break;
            case Answer::kUnknownCode:
                code = 200;
                break;
        }
        uint64_t said = answer_ == Answer::kFewerBytesThanSaid ? 4000 : body.size();
        ByteWriter h;
        h.U64(request);
        h.U64(0);  // proof: no deployment secret
        h.U8(code);
        h.U64(said);
        h.Str(code != 0 ? "a code nobody defined" : "");
        held_.push_back(h.Take());
        const std::string& header = held_.back();
        held_.push_back(std::move(body));
        const std::string& data = held_.back();
        ucp_request_param_t p{};
        ucs_status_ptr_t r = ucp_am_send_nbx(reply_ep_, kAmReply, header.data(), header.size(),
                                             data.data(), data.size(), &p);
        if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);  // completes on its own
        ++grants_answered_;
    }

    bool DoPut(const std::string& agent, uint64_t remote, const std::string& data,
               std::chrono::milliseconds wait) {
        std::string worker;
        if (!HexDecode(std::string_view(agent).substr(0, agent.rfind('.')), &worker)) return false;
        ucp_ep_h ep = Connect(worker);
        if (ep == nullptr) return false;
        const std::string zeros(64, '\0');  // a packed rkey naming no memory domain
        ucp_rkey_h rkey = nullptr;
        if (ucp_ep_rkey_unpack(ep, zeros.data(), &rkey) != UCS_OK) return false;
        rkeys_.push_back(rkey);
        held_.push_back(data);
        ucp_request_param_t p{};
        ucs_status_ptr_t put = ucp_put_nbx(ep, held_.back().data(), data.size(), remote, rkey, &p);
        if (UCS_PTR_IS_ERR(put)) return false;
        if (UCS_PTR_IS_PTR(put)) ucp_request_free(put);
        ucs_status_ptr_t flush = ucp_ep_flush_nbx(ep, &p);
        if (UCS_PTR_IS_ERR(flush)) return false;
        auto until = std::chrono::steady_clock::now() + wait;
        ucs_status_t st = UCS_OK;
        while (UCS_PTR_IS_PTR(flush) && (st = ucp_request_check_status(flush)) == UCS_INPROGRESS &&
               std::chrono::steady_clock::now() < until) {
            ucp_worker_progress(worker_);
        }
        if (UCS_PTR_IS_PTR(flush)) ucp_request_free(flush);
        return st == UCS_OK && std::chrono::steady_clock::now() < until;
    }

    void Loop() {
        while (!stop_.load()) {
            unsigned n = ucp_worker_progress(worker_);
            std::vector<std::function<void()>> now;
            now.swap(deferred_);
            {
                std::lock_guard<std::mutex> lock(mu_);
                for (auto& c : commands_) now.push_back(std::move(c));
                commands_.clear();
            }
            for (auto& f : now) f();
            if (n == 0 && now.empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
    }

    const Answer answer_;
    std::vector<uint8_t> memory_;
    ucp_context_h context_ = nullptr;
    ucp_worker_h worker_ = nullptr;
    ucp_mem_h memh_ = nullptr;
    std::string rkey_;
    std::string address_;
    HandlerArg args_[kLastAm + 1];
    // Only the progress thread touches these (after the constructor).
    std::vector<std::function<void()>> deferred_;
    std::vector<ucp_ep_h> eps_;
    std::vector<ucp_rkey_h> rkeys_;
    ucp_ep_h reply_ep_ = nullptr;
    std::deque<std::string> held_;  // what was sent, kept to the end: UCX may still read it
    std::mutex mu_;
    std::vector<std::function<void()>> commands_;  // from other threads
    std::atomic<bool> stop_{false};
    std::atomic<int> grants_answered_{0};
    std::thread thread_;
};

// `real`'s metadata with its ucx endpoint replaced by the fake's: the regions it lists are what
// the initiator asks the fake to grant.
std::string PointedAt(const std::string& real, const FakeUcxPeer& fake) {
    AgentMetadata md = DecodeMetadata(real).value();
    md.endpoints = {EndpointInfo{"ucx", fake.address()}};
    return EncodeMetadata(md);
}

struct Case {
    Answer answer;
    Code code;
    const char* text;  // in the error
};

// An agent ("agent-t", 4 KiB region filled with pattern 1) and a fake peer that puts 4 KiB of
// 0xab at the region's address under an rkey it made up, never asking for a grant.
struct UnaskedPut {
    explicit UnaskedPut(const std::string& backend)
        : t(ValueOrDie(Agent::Create(TestConfig("agent-t", backend)), "t")),
          rt(ValueOrDie(t->AllocateRegion(kBytes))) {
        FillPattern(rt.base, kBytes, 1);
    }
    // True if UCX confirmed the put within `wait`.
    bool Put(std::chrono::milliseconds wait) {
        AgentMetadata md = DecodeMetadata(t->Metadata()).value();
        return fake.PutUnasked(md.FindEndpoint("ucx")->address, reinterpret_cast<uint64_t>(rt.base),
                               std::string(kBytes, '\xab'), wait);
    }
    static constexpr size_t kBytes = 4096;
    std::unique_ptr<Agent> t;
    RegionInfo rt;
    FakeUcxPeer fake{Answer::kHonest};
};

// UCX's software RMA (what put/get become over tcp) writes wherever an initiator says, under an
// rkey the initiator can make up. An agent without ucx_rma does not enable UCX's RMA feature, so
// its worker runs no such handler: the bytes never land.
TEST(UcxUnaskedPut, AnAgentWithoutRmaIsNotWrittenByARkeyThePeerMadeUp) {
    UnaskedPut u("ucx");
    const size_t n = UnaskedPut::kBytes;
    EXPECT_FALSE(u.Put(std::chrono::milliseconds(1500)));
    EXPECT_EQ(FirstMismatch(u.rt.base, n, 1), -1) << "a made-up rkey wrote into the agent";

    // The agent still serves an honest peer.
    auto a = ValueOrDie(Agent::Create(TestConfig("agent-a", "ucx")), "a");
    RegionInfo la = ValueOrDie(a->AllocateRegion(n));
    ASSERT_TRUE(a->AddPeer(u.t->Metadata()).ok());
    auto r = ValueOrDie(a->PostRead(std::vector<Descriptor>{{la.id, 0, n}}, "agent-t",
                                    std::vector<Descriptor>{{u.rt.id, 0, n}}));
    FERRY_ASSERT_OK(r.Wait(seconds(10)));
    EXPECT_EQ(FirstMismatch(la.base, n, 1), -1);
}

// With ucx_rma on, the same put lands: the trust the docs ask for (transfer-engine.md, "ucx").
TEST(UcxUnaskedPut, WithRmaOnAMadeUpRkeyWritesOverTcp) {
    UnaskedPut u("ucx_rma");
    EXPECT_TRUE(u.Put(std::chrono::milliseconds(5000)));
    EXPECT_EQ(static_cast<uint8_t*>(u.rt.base)[0], 0xab);
}

// Metadata whose ucx endpoint is not "<hex worker address>.<16 hex digit token>": the transfer
// fails naming it, before UCX is asked anything.
TEST(UcxLyingMetadata, AnEndpointAddressThatIsNotHexFailsTheTransferNamingIt) {
    auto a = ValueOrDie(Agent::Create(TestConfig("agent-a", "ucx")), "a");
    auto b = ValueOrDie(Agent::Create(TestConfig("agent-b", "ucx")), "b");
    RegionInfo rb = ValueOrDie(b->AllocateRegion(4096));
    RegionInfo la = ValueOrDie(a->AllocateRegion(4096));
    for (const char* bad : {"zz.00000000c0ffee01", "abc.00000000c0ffee01", "00ff.c0ffee01", "00ff",
                            ".00000000c0ffee01"}) {
        SCOPED_TRACE(bad);
        AgentMetadata md = DecodeMetadata(b->Metadata()).value();
        md.endpoints = {EndpointInfo{"ucx", bad}};
        ASSERT_TRUE(a->AddPeer(EncodeMetadata(md)).ok());
        auto x = a->PostWrite(std::vector<Descriptor>{{la.id, 0, 4096}}, "agent-b",
                              std::vector<Descriptor>{{rb.id, 0, 4096}});
        Status s = x.ok() ? x->Wait(seconds(10)) : x.status();
        EXPECT_THAT(s, StatusHas(Code::kInvalidArgument, "is not <hex worker address>"));
    }
}

std::string CaseName(const ::testing::TestParamInfo<Case>& i) {
    static const char* const kNames[] = {"Honest",      "ShortGrant",         "Truncated",
                                         "GarbageRkey", "FewerBytesThanSaid", "TooLong",
                                         "UnknownCode"};
    return kNames[static_cast<int>(i.param.answer)];
}

class UcxLyingTarget : public ::testing::TestWithParam<Case> {};

TEST(UcxLyingTargetHarness, AnHonestFakeIsWrittenAndReadOneSided) {
    // The fake is a real peer: with an honest grant the bytes land in its memory and come back.
    FakeUcxPeer fake(Answer::kHonest);
    auto a = ValueOrDie(Agent::Create(TestConfig("agent-a", "ucx_rma")), "a");
    auto b = ValueOrDie(Agent::Create(TestConfig("agent-b", "ucx_rma")), "b");
    RegionInfo rb = ValueOrDie(b->AllocateRegion(FakeUcxPeer::kMemory));
    RegionInfo la = ValueOrDie(a->AllocateRegion(2 * FakeUcxPeer::kMemory));
    const size_t n = 256u << 10;
    FillPattern(la.base, n, 3);
    ASSERT_TRUE(a->AddPeer(PointedAt(b->Metadata(), fake)).ok());
    auto w = ValueOrDie(a->PostWrite(std::vector<Descriptor>{{la.id, 0, n}}, "agent-b",
                                     std::vector<Descriptor>{{rb.id, 4096, n}}));
    FERRY_ASSERT_OK(w.Wait(seconds(10)));
    EXPECT_EQ(FirstMismatch(fake.memory() + 4096, n, 3), -1);
    auto r = ValueOrDie(a->PostRead(std::vector<Descriptor>{{la.id, FakeUcxPeer::kMemory, n}},
                                    "agent-b", std::vector<Descriptor>{{rb.id, 4096, n}}));
    FERRY_ASSERT_OK(r.Wait(seconds(10)));
    EXPECT_EQ(FirstMismatch(static_cast<uint8_t*>(la.base) + FakeUcxPeer::kMemory, n, 3), -1);
    EXPECT_EQ(fake.grants_answered(), 1);
    EXPECT_EQ(a->Stats().one_sided_transfers, 2u);
}

TEST_P(UcxLyingTarget, TheTransferFailsNamingTheLieAndTheInitiatorCarriesOn) {
    const Case& c = GetParam();
    FakeUcxPeer fake(c.answer);
    auto a = ValueOrDie(Agent::Create(TestConfig("agent-a", "ucx_rma")), "a");
    auto b = ValueOrDie(Agent::Create(TestConfig("agent-b", "ucx_rma")), "b");
    auto honest = ValueOrDie(Agent::Create(TestConfig("agent-c", "ucx_rma")), "c");
    RegionInfo rb = ValueOrDie(b->AllocateRegion(FakeUcxPeer::kMemory));
    RegionInfo rc = ValueOrDie(honest->AllocateRegion(FakeUcxPeer::kMemory));
    RegionInfo la = ValueOrDie(a->AllocateRegion(FakeUcxPeer::kMemory));
    const size_t n = 64u << 10;
    FillPattern(la.base, n, 9);
    ASSERT_TRUE(a->AddPeer(PointedAt(b->Metadata(), fake)).ok());
    ASSERT_TRUE(a->AddPeer(honest->Metadata()).ok());
    ASSERT_TRUE(honest->AddPeer(a->Metadata()).ok());

    for (bool write : {true, false}) {
        SCOPED_TRACE(write ? "write" : "read");
        std::vector<Descriptor> local{{la.id, 0, n}};
        std::vector<Descriptor> remote{{rb.id, 0, n}};
        auto x =
            write ? a->PostWrite(local, "agent-b", remote) : a->PostRead(local, "agent-b", remote);
        Status s = x.ok() ? x->Wait(seconds(10)) : x.status();
        EXPECT_THAT(s, StatusHas(c.code, c.text));
        // Nothing was moved: the fake's memory is as it was.
        EXPECT_EQ(std::count(fake.memory(), fake.memory() + n, 0), static_cast<long>(n));
    }
    EXPECT_GE(fake.grants_answered(), 1);

    // The initiator still reaches an honest peer and is still served by it.
    auto w = ValueOrDie(a->PostWrite(std::vector<Descriptor>{{la.id, 0, n}}, "agent-c",
                                     std::vector<Descriptor>{{rc.id, 0, n}}));
    FERRY_ASSERT_OK(w.Wait(seconds(10)));
    EXPECT_EQ(FirstMismatch(rc.base, n, 9), -1);
    FillPattern(rc.base, n, 4);
    auto back = ValueOrDie(honest->PostRead(std::vector<Descriptor>{{rc.id, 0, n}}, "agent-a",
                                            std::vector<Descriptor>{{la.id, 0, n}}));
    FERRY_ASSERT_OK(back.Wait(seconds(10)));
    EXPECT_EQ(FirstMismatch(rc.base, n, 9), -1);
}

INSTANTIATE_TEST_SUITE_P(
    Answers, UcxLyingTarget,
    ::testing::Values(Case{Answer::kShortGrant, Code::kOutOfRange,
                           "of 4096 bytes (as peer agent-b granted it)"},
                      Case{Answer::kTruncated, Code::kDataLoss, "sent a malformed grant of region"},
                      Case{Answer::kGarbageRkey, Code::kDataLoss, "does not unpack"},
                      Case{Answer::kFewerBytesThanSaid, Code::kDataLoss, "answered with 100 bytes"},
                      Case{Answer::kTooLong, Code::kDataLoss, "answered with 8208 bytes"},
                      Case{Answer::kUnknownCode, Code::kDataLoss, "malformed reply"}),
    CaseName);

}  // namespace
}  // namespace ferry
