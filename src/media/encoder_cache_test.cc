#include "media/encoder_cache.h"

#include <gtest/gtest.h>

namespace ferry::media {
namespace {

Embeddings Floats(size_t n, float v) { return std::make_shared<std::vector<float>>(n, v); }

TEST(EncoderCache, KeepsTheMostRecentlyUsedUnderItsCapacity) {
    EncoderCache c(3 * 400);  // three entries of 100 floats
    c.Insert("a", Floats(100, 1));
    c.Insert("b", Floats(100, 2));
    c.Insert("c", Floats(100, 3));
    Embeddings held = c.Find("b");
    ASSERT_NE(c.Find("c"), nullptr);
    ASSERT_NE(c.Find("a"), nullptr);  // b is now the least recently used: it goes first
    c.Insert("d", Floats(100, 4));
    EXPECT_EQ(c.Find("b"), nullptr);
    EXPECT_EQ(held->at(0), 2);  // still valid for its holder
    EXPECT_EQ(c.Find("a")->at(0), 1);
    EXPECT_EQ(c.Find("d")->at(0), 4);
    c.Insert("d", Floats(100, 9));  // an entry there stays
    EXPECT_EQ(c.Find("d")->at(0), 4);
    c.Insert("huge", Floats(1000, 5));  // over the capacity: not kept, nothing evicted
    EXPECT_EQ(c.Find("huge"), nullptr);
    EncoderCacheStats s = c.Stats();
    EXPECT_EQ(s.entries, 3u);
    EXPECT_EQ(s.bytes, 1200u);
    EXPECT_EQ(s.evictions, 1u);
    EXPECT_EQ(s.inserts, 4u);
    EXPECT_EQ(s.hits, 6u);
    EXPECT_EQ(s.misses, 2u);
    EXPECT_EQ(s.capacity_bytes, 1200u);

    EncoderCache none(0);
    none.Insert("a", Floats(1, 1));
    EXPECT_EQ(none.Find("a"), nullptr);
}

}  // namespace
}  // namespace ferry::media
