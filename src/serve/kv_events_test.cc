// The KV-event publisher's batch bound: a batch that would encode larger than subscribers take
// (ZMQ_MAXMSGSIZE on their sockets) goes out as smaller batches, in order, each with its own
// sequence number, and nothing is lost. Read back through the replay socket, which answers with
// exactly what was published.
#include "serve/kv_events.h"

#include <gtest/gtest.h>
#include <zmq.h>

#include <chrono>
#include <string>
#include <vector>

#include "router/kv_index.h"
#include "router/zmq_socket.h"
#include "testing/testing.h"

namespace ferry::serve {
namespace {

TEST(KvEventPublisher, ABatchLargerThanSubscribersTakeGoesOutSplitInOrder) {
    KvEventsConfig c;
    c.endpoint = "tcp://127.0.0.1:0";
    c.bind = true;
    c.replay_endpoint = "tcp://127.0.0.1:0";
    c.max_batch_bytes = 600;
    auto pub = testing::ValueOrDie(KvEventPublisher::Start(c));
    // 20 stored blocks of 16 tokens, one event each: ~120 bytes an event, ~2.4 KB in all.
    std::vector<schema::KvCacheEvent> events;
    BlockHash parent = RootBlockHash("0");
    for (int i = 0; i < 20; ++i) {
        schema::KvCacheEvent e;
        std::vector<int32_t> tokens(16, i);
        e.hashes = {HashBlockTokens(parent, tokens)};
        e.parent = parent;
        e.tokens = tokens;
        parent = e.hashes[0];
        events.push_back(std::move(e));
    }
    const std::vector<schema::KvCacheEvent> sent = events;
    pub->Publish(std::move(events));
    ASSERT_TRUE(testing::WaitUntil([&] { return pub->Stats().events == 20; }));
    EXPECT_GE(pub->Stats().batches, 4u);  // ~2.4 KB in batches of at most 600 bytes

    void* ctx = zmq_ctx_new();
    void* dealer = zmq_socket(ctx, ZMQ_DEALER);
    router::BoundZmqSocket(dealer, schema::kMaxKvEventBatchBytes);
    ASSERT_EQ(zmq_connect(dealer, pub->replay_endpoint().c_str()), 0);
    const std::string from = schema::KvEventSeqBytes(0);
    zmq_send(dealer, "", 0, ZMQ_SNDMORE);
    zmq_send(dealer, from.data(), from.size(), 0);
    std::vector<BlockHash> got;
    int64_t next = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
        zmq_pollitem_t item{dealer, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, 100) <= 0) continue;
        const std::vector<std::string> frames = router::ReceiveZmqFrames(dealer);
        ASSERT_EQ(frames.size(), 3u);
        const std::optional<int64_t> seq = schema::KvEventSeqOf(frames[1]);
        ASSERT_TRUE(seq.has_value());
        if (*seq == -1) break;
        EXPECT_EQ(*seq, next++) << "in order, no gap";
        EXPECT_LE(frames[2].size(), c.max_batch_bytes);
        auto batch = schema::DecodeKvEventBatch(frames[2]);
        ASSERT_TRUE(batch.ok()) << batch.status().ToString();
        for (const schema::KvCacheEvent& e : *batch)
            got.insert(got.end(), e.hashes.begin(), e.hashes.end());
    }
    zmq_close(dealer);
    zmq_ctx_term(ctx);
    ASSERT_EQ(got.size(), sent.size());
    for (size_t i = 0; i < sent.size(); ++i) EXPECT_EQ(got[i], sent[i].hashes[0]) << i;
}

}  // namespace
}  // namespace ferry::serve
