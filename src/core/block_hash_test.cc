// The block hashes against vectors computed outside ferry, as vLLM computes them:
//   import cbor2, hashlib
//   h = lambda x: hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()
//   root = h("0"); b0 = h((root, tuple(range(16)), None)); b1 = h((b0, tuple(TOKENS), None))
// (Debian's python3-cbor2; vLLM's sha256_cbor and hash_block_tokens with PYTHONHASHSEED=0.)
#include "core/block_hash.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace ferry {
namespace {

std::string Hex(const BlockHash& h) { return HexEncode(h.data(), h.size()); }

// vLLM's multimodal extra keys (_gen_mm_extra_hash_keys: the identifiers of the inputs that
// overlap the block), computed as above with extra keys ("ab" * 32,) and ("ab" * 32, "cd" * 32).
TEST(BlockHash, CarriesTheMultimodalInputsOfABlockAsVllmsExtraKeys) {
    const BlockHash root = RootBlockHash("0");
    std::vector<int32_t> prompt(48);
    for (int i = 0; i < 16; ++i) {
        prompt[i] = i;
        prompt[16 + i] = 100 + i;
        prompt[32 + i] = 200 + i;
    }
    std::string ha, hb;
    for (int i = 0; i < 32; ++i) ha += "ab", hb += "cd";
    // Image a on tokens 20..35 (blocks 1 and 2), image b on 40..44 (block 2).
    const std::vector<MmSpan> mm = {{20, 16, ha}, {40, 5, hb}};
    EXPECT_TRUE(MmExtraKeys(mm, 0, 16).empty());
    EXPECT_EQ(MmExtraKeys(mm, 16, 32), std::vector<std::string_view>({ha}));
    EXPECT_EQ(MmExtraKeys(mm, 32, 48), std::vector<std::string_view>({ha, hb}));
    EXPECT_TRUE(MmExtraKeys(mm, 48, 64).empty());
    const auto all = HashFullBlocks(root, prompt, 16, mm);
    ASSERT_EQ(all.size(), 3u);
    EXPECT_EQ(Hex(all[0]), "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c");
    EXPECT_EQ(Hex(all[1]), "b7ba220a98c421574607d66aba72563b2e7c09b24ecd9c1dc1c394849cf08a5f");
    EXPECT_EQ(Hex(all[2]), "c7d740944fce392fff2c44eea1181545a4e44a011b64c21f1a40fb16143b6368");
    // Without them the blocks after the first hash as plain text.
    EXPECT_NE(HashFullBlocks(root, prompt, 16)[1], all[1]);
}

TEST(BlockHash, EqualsVllmsSha256CborChain) {
    const BlockHash root = RootBlockHash("0");
    EXPECT_EQ(Hex(root), "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e");
    EXPECT_EQ(Hex(RootBlockHash("42")),
              "9fa6eb003f14425eb9c8e6baacfbcaab26257357b829c7bfa74ffcc4f31c1780");
    std::vector<int32_t> first(16);
    std::iota(first.begin(), first.end(), 0);
    const BlockHash b0 = HashBlockTokens(root, first);
    EXPECT_EQ(Hex(b0), "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c");
    // Every width of CBOR integer: 1 byte (< 24), 2, 3 and 5 bytes.
    const std::vector<int32_t> second = {1000, 70000, 5, 255, 256, 65535, 65536, 23,
                                         24,   0,     1, 2,   3,   4,     5,     151935};
    const BlockHash b1 = HashBlockTokens(b0, second);
    EXPECT_EQ(Hex(b1), "d2b32f9396b185ff7774fa25213871fb8f4d3dc5120b4006a5bb891856cf2e5a");
    EXPECT_EQ(BlockHashToInt(b1), 11942289574531640922ull) << "vLLM's int form: the last 8 bytes";

    std::vector<int32_t> prompt = first;
    prompt.insert(prompt.end(), second.begin(), second.end());
    prompt.insert(prompt.end(), {7, 7, 7});  // a partial block is not hashed
    const std::vector<BlockHash> all = HashFullBlocks(root, prompt, 16);
    ASSERT_EQ(all.size(), 2u);
    EXPECT_EQ(all[0], b0);
    EXPECT_EQ(all[1], b1);
    EXPECT_TRUE(HashFullBlocks(root, prompt, 0).empty());
    EXPECT_NE(HashBlockTokens(RootBlockHash("1"), first), b0) << "the seed changes every hash";
}

}  // namespace
}  // namespace ferry
